"""Time this rank's GPU stream spends blocked on communication, on the device's own clock.

A straggler is invisible in a step's wall time: every collective makes the fast ranks wait for
the slow one, so all ranks take equally long. What differs is how much of the step each rank
spent *waiting*; the straggler waits least. ``collectives``/``p2p`` bracket every blocking point
(a synchronous collective's launch, an async handle's ``wait()``) with this clock, and
``training/stragglers.py`` subtracts it from the step time to get each rank's busy time.

Under NCCL the host does not block there: a synchronous collective runs on the caller's stream
and ``wait()`` makes that stream wait, so each bracket is a pair of CUDA events on the current
stream, resolved only when ``seconds`` is called (at a log step, where the record's host read
has already synced). On the host (CPU, gloo, a dry run) nothing is bracketed: there the busy
time is the main thread's CPU time, which a blocked wait does not consume.
"""

from __future__ import annotations

import contextlib

import torch

from zerotron.parallel import host_sync


class WaitClock:
    def __init__(self) -> None:
        self._spans: list = []  # (start, end) CUDA event pairs around each blocking point
        self.enabled = False  # off until a trainer asks for it: tests and tools pay nothing

    @contextlib.contextmanager
    def blocked(self, tensor: torch.Tensor | None):
        """Count the enclosed call as time the stream of ``tensor``'s device is blocked."""
        cuda = tensor is not None and tensor.device.type == "cuda" and not host_sync.simulated()
        if not (self.enabled and cuda):
            yield
            return
        start = host_sync.event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end = host_sync.event(enable_timing=True)
            end.record()
            self._spans.append((start, end))

    def take(self) -> list:
        """The spans recorded since the last call, not yet resolved (no sync); start over."""
        taken, self._spans = self._spans, []
        return taken


def seconds(spans: list) -> float:
    """The seconds ``spans`` cover; waits for the last one (call it at a log step, where the
    record's host read has already synced the stream)."""
    if not spans:
        return 0.0
    spans[-1][1].synchronize()
    return sum(s.elapsed_time(e) for s, e in spans) / 1e3
