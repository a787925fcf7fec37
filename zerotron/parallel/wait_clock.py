"""Time this rank spends blocked on communication, on the device's own clock.

A straggler is invisible in a step's wall time: every collective makes the fast ranks wait for
the slow one, so all ranks take equally long. What differs is how much of the step each rank
spent *waiting*; the straggler waits least. ``collectives``/``p2p`` bracket every blocking point
(a synchronous collective's launch, an async handle's ``wait()``) with this clock, and
``training/stragglers.py`` subtracts it from the step time to get each rank's busy time.

On the host (CPU, gloo) the brackets are ``time.perf_counter``. Under NCCL the host does not
block there: a synchronous collective runs on the caller's stream and ``wait()`` makes that
stream wait, so each bracket is a pair of CUDA events on the current stream, resolved only when
``seconds`` is called (at a log step, where the record's host read has already synced).
Under a dry run (``host_sync.simulate``) the host clock is used, as ``pipeline_clock`` does.
"""

from __future__ import annotations

import contextlib
import time

import torch

from zerotron.parallel import host_sync


class WaitClock:
    def __init__(self) -> None:
        self._host_s = 0.0
        self._spans: list = []  # CUDA: (start, end) event pairs around each blocking point
        self.enabled = False  # off until a trainer asks for it: tests and tools pay nothing

    @contextlib.contextmanager
    def blocked(self, tensor: torch.Tensor | None):
        """Count the enclosed call as time blocked on communication (``tensor``: its device)."""
        if not self.enabled:
            yield
            return
        cuda = tensor is not None and tensor.device.type == "cuda" and not host_sync.simulated()
        if cuda:
            start = host_sync.event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end = host_sync.event(enable_timing=True)
                end.record()
                self._spans.append((start, end))
            return
        start_s = time.perf_counter()
        try:
            yield
        finally:
            self._host_s += time.perf_counter() - start_s

    def take(self) -> tuple[float, list]:
        """What was blocked since the last call -- host seconds and CUDA event spans, not yet
        resolved (no sync) -- and start over."""
        taken = (self._host_s, self._spans)
        self._host_s, self._spans = 0.0, []
        return taken


def seconds(host_s: float, spans: list) -> float:
    """The seconds of ``take()``'s result; with CUDA spans, waits for the last one (call it at a
    log step, where the record's host read has already synced the stream)."""
    if spans:
        spans[-1][1].synchronize()
        host_s += sum(s.elapsed_time(e) for s, e in spans) / 1e3
    return host_s
