"""Every read of a device value by the host goes through here: counted, and simulated under a dry run.

On a GPU a host read (``.item()``, ``float(t)``, ``.tolist()``, ``bool(t)``) waits for every kernel
queued before it, so the CPU stops feeding the GPU: a step that reads the loss of each
micro-batch drains the queue once per micro-batch. The training step therefore keeps its values
on the device (loss sums, the clipping coefficient, the grad norm) and reads them here, where
each read is counted (``HostSyncs``) so a test can hold the step to its budget: in bf16 none per
micro-batch and at most one per step; fp16's overflow decision is the one a step cannot avoid.

Under ``simulate()`` (the dry run on fake tensors and the ``fake`` process group, which hold no
values) a read returns its ``placeholder`` instead -- a value that keeps the step on its normal
path (a finite norm, no overflow) -- and is still counted. The same switch makes the CUDA objects
that need a driver (streams, events, pinned host memory, device synchronisation) no-ops:
``stream``/``event``/``pinned``/``synchronize`` are the one place the code asks for them.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class HostSyncs:
    """This process's count of host reads, total and per ``reason`` (what was read, e.g. ``"clip"``)."""

    def __init__(self) -> None:
        self.total = 0
        self.by_reason: dict[str, int] = {}

    def add(self, reason: str) -> None:
        self.total += 1
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1


class _State:
    """Process-wide, not thread-local: autograd runs a device's backward on its own thread."""

    def __init__(self) -> None:
        self.counter = HostSyncs()
        self.simulated = False


_state = _State()


def counter() -> HostSyncs:
    """The running counter; difference ``counter().total`` around a step to count its reads."""
    return _state.counter


@contextlib.contextmanager
def counting():
    """``with counting() as syncs:`` -- ``syncs`` counts only the reads made inside the block."""
    outer, _state.counter = _state.counter, HostSyncs()
    try:
        yield _state.counter
    finally:
        inner, _state.counter = _state.counter, outer
        outer.total += inner.total
        for reason, n in inner.by_reason.items():
            outer.by_reason[reason] = outer.by_reason.get(reason, 0) + n


def simulated() -> bool:
    """Whether tensors hold no values (a dry run): reads return placeholders, CUDA objects are no-ops."""
    return _state.simulated


@contextlib.contextmanager
def simulate():
    """Run the block as a dry run (see the module docstring)."""
    before, _state.simulated = _state.simulated, True
    try:
        yield
    finally:
        _state.simulated = before


def read(value: torch.Tensor, reason: str, placeholder: Any = 0.0) -> Any:
    """The host copy of ``value``: a Python number for a one-element tensor, else a (nested) list.

    ``reason`` names the read in the counter; ``placeholder`` is returned under ``simulate()``
    (give one with the shape the caller expects: a list for a multi-element tensor)."""
    _state.counter.add(reason)
    if _state.simulated:
        return placeholder
    return value.item() if value.numel() == 1 else value.tolist()


# CUDA objects that need a driver ---------------------------------------------------------------
def stream(device: torch.device):
    """A side CUDA stream on ``device``, or None (CPU, or a dry run): callers then copy in order."""
    if device.type != "cuda" or _state.simulated:
        return None
    return torch.cuda.Stream(device=device)


def event(enable_timing: bool = False):
    """A CUDA event to record, or None under a dry run (callers treat None as already complete).
    ``enable_timing``: for ``elapsed_time`` (the pipeline's compute clock)."""
    return None if _state.simulated else torch.cuda.Event(enable_timing=enable_timing)


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued kernels (CUDA only; a no-op on the CPU and under a dry run)."""
    if device.type == "cuda" and not _state.simulated:
        torch.cuda.synchronize(device)


def pinned_rounding(tensors) -> int:
    """Bytes the pinned ``tensors`` take beyond their size: torch's caching host allocator rounds
    every pinned block up to a power of two, so a 5 GiB pinned state holds 8 GiB of host RAM."""
    extra = 0
    for t in tensors:
        n = t.untyped_storage().nbytes() if t is not None and _is_pinned(t) else 0
        extra += (1 << (n - 1).bit_length()) - n if n else 0
    return extra


def _is_pinned(t: torch.Tensor) -> bool:
    real = t.device.type == "cpu" and not _state.simulated and torch.cuda.is_available()
    return real and t.is_pinned()


def pinned(device: torch.device) -> bool:
    """Whether host buffers that feed ``device`` should be pinned: only for a real CUDA device."""
    return device.type == "cuda" and not _state.simulated and torch.cuda.is_available()
