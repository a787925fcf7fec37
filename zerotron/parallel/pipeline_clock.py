"""How long a pipeline rank computes and how long its step takes, on the device's own clock.

The measured bubble of a rank is ``1 - compute / wall``. On the host (CPU) that is
``time.perf_counter`` around each forward and backward. On a GPU kernels are queued
asynchronously, so the host time around a forward measures its launch, not its run: there each
compute is bracketed by CUDA events recorded on the current stream (after the stream has been
told to wait for the compute's received tensor, so a transfer stall is idle time, not compute),
and so is the whole step. Events are read only when a figure is asked for -- one host sync then
(counted by ``host_sync``, reason ``"pipeline_clock"``), none in the step itself. Under a dry run
(``host_sync.simulate``: no driver) the host clock is used.
"""

from __future__ import annotations

import contextlib
import time

import torch

from zerotron.parallel import host_sync


class Clock:
    def __init__(self, device: torch.device):
        self.events = device.type == "cuda" and not host_sync.simulated()
        self._spans: list = []  # CUDA: (start, end) event pairs of the computes
        self._compute = 0.0
        self._start = self._event_now() if self.events else time.perf_counter()
        self._end = None
        self._resolved: tuple[float, float] | None = None

    @staticmethod
    def _event_now():
        ev = host_sync.event(enable_timing=True)
        ev.record()
        return ev

    @contextlib.contextmanager
    def compute(self):
        """Count the enclosed forward or backward as compute."""
        if self.events:
            start = self._event_now()
            try:
                yield
            finally:
                self._spans.append((start, self._event_now()))
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self._compute += time.perf_counter() - start

    def stop(self) -> None:
        """The step's end (after the gradient reduction and the loss broadcast)."""
        self._end = self._event_now() if self.events else time.perf_counter()

    def _resolve(self) -> tuple[float, float]:
        if self._resolved is None:
            if self._end is None:
                raise RuntimeError("Clock: read before stop()")
            if self.events:
                host_sync.counter().add("pipeline_clock")
                self._end.synchronize()
                compute = sum(s.elapsed_time(e) for s, e in self._spans) / 1e3
                self._resolved = (compute, self._start.elapsed_time(self._end) / 1e3)
            else:
                self._resolved = (self._compute, self._end - self._start)
        return self._resolved

    def compute_s(self) -> float:
        return self._resolve()[0]

    def wall_s(self) -> float:
        return self._resolve()[1]
