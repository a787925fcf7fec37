"""What stage 3 keeps gathered between uses, and what autograd may keep of a gathered parameter.

Two things decide how much of the partitioned model is resident at once (ZeRO §5.3):

* **Saved views.** Autograd saves tensors for backward, and many of them are views of a gathered
  parameter (``addmm`` saves ``weight.t()``, LayerNorm its weight). Such a view holds the gathered
  buffer alive after the unit released it, so without care every gathered unit outlives forward
  and backward gathers a second copy. ``SavedParamViews`` is a pair of
  ``torch.autograd.graph.saved_tensors_hooks`` installed around the model's forward: a saved
  tensor that lives in a gathered buffer is packed as (group, size, stride, offset) -- the
  parameter *handle*, not its data -- and unpacked in backward from the buffer as gathered then
  (re-gathered if it is not), which is what DeepSpeed's ZeRO-3 linear does by saving the
  parameter instead of its data. Any other tensor is saved unchanged.
* **Reuse.** DeepSpeed's ``stage3_max_reuse_distance``: a unit released in forward stays gathered
  when the elements of other units gathered before its next use (its backward) are at most this
  distance, and ``stage3_max_live_parameters`` caps the gathered elements such retention and the
  prefetch may reach. ``UseTrace`` records the order in which units are used over the first
  micro-batch's forward and backward and answers that distance. A unit run again in backward by
  activation checkpointing (its recompute) stays gathered for the backward that follows at once
  whatever the distance, so a checkpointed step all-gathers 2Ψ + the reduce-scatter's Ψ = 3Ψ on
  DP (§7.2.2), not 4Ψ.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch


def in_backward() -> bool:
    """True while autograd's engine runs a backward (e.g. a checkpoint's recompute)."""
    return torch._C._current_graph_task_id() != -1


class _ParamView(NamedTuple):
    group: int
    size: torch.Size
    stride: tuple
    offset: int


class SavedParamViews:
    """Saved-tensor hooks that store views of gathered buffers as handles (see the module docstring).

    ``full`` is the gatherer's group -> gathered buffer map; ``regather(g)`` returns group ``g``'s
    gathered buffer, gathering it if it was released. ``buffers`` maps a storage key to its group;
    a key is trusted only while that group's current buffer still has it (a freed buffer's key
    may be reused by any later storage).
    """

    def __init__(self, full: dict, regather):
        self.full, self.regather = full, regather
        self.buffers: dict[int, int] = {}
        self.active = None

    @staticmethod
    def key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata

    def pack(self, t: torch.Tensor):
        if not self.buffers:
            return t
        k = self.key(t)
        g = self.buffers.get(k)
        if g is None or g not in self.full or self.key(self.full[g]) != k:
            return t
        return _ParamView(g, t.size(), t.stride(), t.storage_offset())

    def unpack(self, saved):
        if not isinstance(saved, _ParamView):
            return saved
        return self.regather(saved.group).as_strided(saved.size, saved.stride, saved.offset)

    def enter(self) -> None:
        if self.active is None:
            self.active = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            self.active.__enter__()

    def exit(self) -> None:
        if self.active is not None:
            active, self.active = self.active, None
            active.__exit__(None, None, None)


class UseTrace:
    """The units in the order they are used in one micro-batch (forward pre-hooks, backward fetches),
    recorded once; then, at any point, the elements of other units used before a unit's next use."""

    def __init__(self, unit_numel: list[int]):
        self.unit_numel = unit_numel
        self.trace: list[int] = []
        self.recording = True
        self.cursor = -1

    def begin_microbatch(self) -> None:
        self.cursor = -1

    def use(self, ui: int) -> None:
        self.cursor += 1
        if self.recording:
            self.trace.append(ui)

    def finish(self) -> None:
        """End of the first backward: the trace is complete."""
        if self.recording and self.trace:
            self.recording = False

    def discard(self) -> None:
        """Forget a partial recording (an inference forward: the trace must be a training micro-batch's)."""
        if self.recording:
            self.trace.clear()

    def reused_within(self, ui: int, limit: float) -> bool:
        """Whether ``ui`` is used again in this micro-batch with at most ``limit`` elements of other
        units used before -- DeepSpeed's walk from the current step of its trace, stopped at the limit
        (it runs on every release). False while nothing is known yet."""
        if self.recording or self.cursor >= len(self.trace):
            return False
        between = 0
        for u in itertools.islice(self.trace, self.cursor + 1, None):
            if u == ui:
                return True
            between += self.unit_numel[u]
            if between > limit:
                return False
        return False
