"""The trainer's memory figures: peak live bytes per category and per phase, measured, not summed.

``MemoryTracker`` (``parallel/memory_tracker.py``) counts every storage alive; the optimizer only
says *which* of them are parameters, gradients and optimizer states (``live_tensors``), never how
big they are. Construction is tracked once (a ZeRO rank must not hold the whole model while it is
built), then one step per log interval: tracking costs ~15 % of a CPU step, so sampling keeps the
run's speed. Storages that persist and are first allocated in an untracked step are not seen;
zerotron allocates its buffers at construction or in the first step, which is always tracked.
On CUDA ``torch.cuda.max_memory_allocated`` is logged beside the tracker's figure.
"""

from __future__ import annotations

import contextlib

from zerotron.parallel.memory_tracker import CATEGORIES, MemoryTracker


class StepMemory:
    def __init__(self, interval: int, device_type: str | None = None):
        self.tracker = MemoryTracker(device_type)
        self.interval = max(1, interval)
        self.active = False
        self._construction: int | None = None

    @contextlib.contextmanager
    def construction(self):
        with self.tracker.phase("construction"):
            yield
        self._construction = self.tracker.by_phase["construction"]

    def register(self, optimizer) -> None:
        for category, tensors in optimizer.live_tensors().items():
            self.tracker.register(category, tensors)

    def begin_step(self, step: int, optimizer) -> None:
        """Track step ``step`` (1-based) if it is the first or ends a log interval."""
        self.active = step == 1 or step % self.interval == 0
        if self.active:
            self.register(optimizer)  # parameters may have been rebound since (stage 3 gathers)
            self.tracker.reset_peaks()

    def phase(self, name: str):
        return self.tracker.phase(name) if self.active else contextlib.nullcontext()

    def train_step(self, step: int, model, optimizer, ids) -> int:
        """One pp = 1 step on ``ids`` (its own labels), each phase tracked: the benchmarks' loop
        (the trainer runs ``run_step`` instead, which knows micro-batches and pipelines). Returns
        the bytes alive as it began (parameters, gradient buffers, optimizer states)."""
        self.begin_step(step, optimizer)
        base = self.tracker.total()
        with self.phase("forward"):
            loss = model(ids, ids)
        with self.phase("backward"):
            optimizer.backward(loss)
        with self.phase("step"):
            optimizer.step()
        return base

    def record(self) -> dict:
        """``mem_peak_bytes``, ``mem_peak_<category>`` and ``mem_<phase>_peak_bytes`` of the last tracked step."""
        rep = self.tracker.report()
        out = {"mem_peak_bytes": rep["peak_bytes"]}
        out.update({f"mem_peak_{c}": rep["by_category"][c] for c in CATEGORIES})
        out.update({f"mem_{phase}_peak_bytes": b for phase, b in rep["by_phase"].items()})
        if self._construction is not None:
            out["mem_construction_peak_bytes"] = self._construction
        return out
