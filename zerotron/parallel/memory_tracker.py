"""Live tensor memory of this rank, measured from the allocator's side: by category and by phase.

A ZeRO figure must not be checked with the optimizer's own bookkeeping (``memory_report`` sums
numel × element size of the tensors the optimizer *knows about*). This tracker counts what is
actually alive: every storage an operator creates while tracking, and every storage handed to
``register``, from the moment it is seen until Python frees it (a weak reference per storage).
Views share their storage, so nothing is counted twice; a tensor autograd saved for backward stays
counted until backward frees it -- which is exactly what the optimizer cannot see.

Categories: ``parameters``, ``gradients``, ``optimizer_states`` (masters and moments), are the
storages registered as such (the owner names them, the tracker measures them); everything else is
named by the phase that created it: ``activations`` (forward), ``temporaries`` (backward and step),
``other`` (construction and anything before). ``phase(name)`` records the peak inside it, with the
breakdown at that moment.

Why not ``torch.distributed._tools.MemTracker``: it classifies gradients by autograd's ``.grad``
(ZeRO's flat gradient partitions are not ``.grad``), cannot be told that a tensor holds optimizer
state unless it is a ``torch.optim.Optimizer``, and refuses a root module called twice in one
iteration (every pipeline micro-batch). The mechanism is the same: a ``TorchDispatchMode``.

Cost: one Python call per operator while tracking (a tiny GPT step ~2x slower on CPU), so the
trainer tracks one step per log interval, not every step. ``torch.cuda.max_memory_allocated`` is
reported beside it on CUDA.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

CATEGORIES = ("parameters", "gradients", "optimizer_states", "activations", "temporaries", "other")
_PHASE_CATEGORY = {"forward": "activations", "backward": "temporaries", "step": "temporaries"}


class MemoryTracker(TorchDispatchMode):
    """Use as ``with tracker.phase("forward"): ...``; read ``report()``. One tracker per rank."""

    def __init__(self, device_type: str | None = None) -> None:
        """``device_type`` (e.g. ``"cuda"``): count only storages on that kind of device -- a GPU's
        memory, not the host buffers of CPU offload beside it. None counts every storage."""
        super().__init__()
        self.device_type = device_type
        self._seen = WeakIdKeyDictionary()  # storage -> [nbytes, category]
        self._refs: dict[int, weakref.ref] = {}  # keeps the weak references (and their callbacks) alive
        self.current: dict[str, int] = defaultdict(int)
        self.peak_bytes, self.peak_by_category = 0, dict.fromkeys(CATEGORIES, 0)
        self.category_peaks = dict.fromkeys(CATEGORIES, 0)  # each category's own highest, at any moment
        self.by_phase: dict[str, int] = {}
        self._phase: str | None = None
        self._phase_peak = 0
        self._depth = 0

    # what is alive ---------------------------------------------------------------------------
    def register(self, category: str, tensors: Iterable[torch.Tensor | None]) -> None:
        """Name the category of these tensors' storages (counting them if not seen yet)."""
        if category not in CATEGORIES:
            raise ValueError(f"category={category!r}: use one of {CATEGORIES}")
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._see(t, category, rename=True)

    def _see(self, t: torch.Tensor, category: str, rename: bool = False) -> None:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
            return
        if t.device.type == "meta":  # shape only: a model built on meta holds no memory yet
            return
        if self.device_type is not None and t.device.type != self.device_type:  # a fake tensor's storage is meta
            return
        entry = self._seen.get(st)
        nbytes = st.nbytes()
        if entry is None:
            entry = self._seen[st] = [nbytes, category]
            ref = weakref.ref(st, self._freed(entry))
            self._refs[id(ref)] = ref
            self._add(category, nbytes)
            return
        if rename and entry[1] != category:
            self.current[entry[1]] -= entry[0]
            self.current[category] += entry[0]
            entry[1] = category
        if entry[0] != nbytes:  # resize_ (stage 3 releases parameters this way in some codes)
            self._add(entry[1], nbytes - entry[0])
            entry[0] = nbytes

    def _freed(self, entry: list):
        def callback(ref) -> None:  # entry is [nbytes, category] as they are when the storage dies
            self.current[entry[1]] -= entry[0]
            self._refs.pop(id(ref), None)
        return callback

    def _add(self, category: str, nbytes: int) -> None:
        self.current[category] += nbytes
        if self.current[category] > self.category_peaks.get(category, 0):
            self.category_peaks[category] = self.current[category]
        total = self.total()
        if total > self._phase_peak:
            self._phase_peak = total
        if total > self.peak_bytes:
            self.peak_bytes = total
            self.peak_by_category = self.breakdown()

    def total(self) -> int:
        return sum(self.current.values())

    def breakdown(self) -> dict[str, int]:
        """Live bytes per category now."""
        return {c: self.current.get(c, 0) for c in CATEGORIES}

    # phases ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str):
        """Track everything created inside; ``by_phase[name]`` keeps the highest peak seen in it."""
        outer, outer_peak = self._phase, self._phase_peak
        self._phase, self._phase_peak = name, self.total()
        try:
            with self:
                yield self
        finally:
            self.by_phase[name] = max(self.by_phase.get(name, 0), self._phase_peak)
            self._phase, self._phase_peak = outer, max(outer_peak, self._phase_peak)

    def __enter__(self):
        self._depth += 1
        return super().__enter__() if self._depth == 1 else self

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            return super().__exit__(*exc)
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        category = _PHASE_CATEGORY.get(self._phase, "other")
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._see(t, category)
        return out

    def report(self) -> dict:
        """``{"peak_bytes", "by_category": {...} at the peak, "by_phase": {phase: peak}}``."""
        return {"peak_bytes": self.peak_bytes, "by_category": dict(self.peak_by_category),
                "by_phase": dict(self.by_phase)}

    def reset_peaks(self) -> None:
        """Start a new measurement window from what is alive now (keeps tracking the live storages)."""
        self.peak_bytes = self.total()
        self.peak_by_category = self.breakdown()
        self.category_peaks = self.breakdown()
        self.by_phase = {}
