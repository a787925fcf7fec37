"""Seconds spent in each phase of a step -- forward, backward, the optimizer step -- for
``logging.wall_clock_breakdown`` (DeepSpeed's ``wall_clock_breakdown``).

``run_step`` already names its phases for the memory measurement (``StepMemory.phase``); this
wraps that object and times the same phases, summed over the logging window and reported as a
per-step mean in the metrics record (``time_forward_s``, ``time_backward_s``, ``time_step_s``;
``time_forward_backward_s`` in a pipeline, whose schedule interleaves them). Like DeepSpeed's
timers it synchronizes the device at each phase boundary, so a step is slower with it on; it is
off by default and costs nothing then (the trainer passes ``StepMemory`` itself).
"""

from __future__ import annotations

import contextlib
import time

import torch

from zerotron.parallel import host_sync


class PhaseTimes:
    def __init__(self, inner, device: torch.device):
        self.inner, self.device = inner, device
        self.seconds: dict[str, float] = {}
        self.steps = 0

    def _sync(self) -> None:
        host_sync.synchronize(self.device)

    @contextlib.contextmanager
    def phase(self, name: str):
        with self.inner.phase(name):
            self._sync()
            start = time.perf_counter()
            try:
                yield
            finally:
                self._sync()
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def step_done(self) -> None:
        self.steps += 1

    def record(self) -> dict:
        """``time_<phase>_s``: mean seconds per step since the last record; then starts over."""
        n = max(1, self.steps)
        out = {f"time_{name}_s": total / n for name, total in self.seconds.items()}
        self.seconds, self.steps = {}, 0
        return out
