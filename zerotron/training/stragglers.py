"""Name a rank that is alive but slow: each rank's busy time per step, compared at every log step.

A slow rank (a throttled GPU, a noisy neighbour, a slow data read) hides in the step time,
because every collective makes the others wait for it; the heartbeat sees it alive. What tells
it apart is that it waits least. Busy time is the step's time less the time this rank was
blocked in communication (``parallel/wait_clock.py``); it is gathered over the world at each log
step and a rank above ``logging.straggler_factor`` x the median is named, like Megatron-LM's
straggler detector names its slowest ranks. One all-gather of a float and one host read per log
interval (reason ``"stragglers"``); nothing per step but a clock read (CUDA: an event).
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

from zerotron.parallel import collectives as C
from zerotron.parallel import host_sync
from zerotron.parallel.wait_clock import seconds


class StragglerWatch:
    def __init__(self, grid, device: torch.device, factor: float):
        self.grid, self.device, self.factor = grid, device, factor
        self.clock = grid.stats.waits
        self.clock.enabled = factor > 0
        self._events = device.type == "cuda" and not host_sync.simulated()
        self._spans: list = []  # CUDA: (start, end) events of each step of the window
        self._step_s, self._steps = 0.0, 0
        self._wait_host_s, self._wait_spans = 0.0, []  # blocked in the window's steps
        self.message = ""  # the last verdict, printed by rank 0

    def _now(self):
        if self._events:
            ev = host_sync.event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    @contextlib.contextmanager
    def step(self):
        """Bracket one training step; waits outside steps (evaluation, saves) are not counted."""
        if self.factor <= 0:
            yield
            return
        self.clock.take()  # drop what was blocked between steps (evaluation, a save)
        start = self._now()
        yield
        end = self._now()
        if self._events:
            self._spans.append((start, end))
        else:
            self._step_s += end - start
        host_s, spans = self.clock.take()
        self._wait_host_s += host_s
        self._wait_spans += spans
        self._steps += 1

    def read(self) -> dict:
        """``busy_s_median``/``busy_s_max`` (seconds per step over the window) and
        ``straggler_ranks``; sets ``message`` when a rank is above the factor."""
        if self.factor <= 0 or self._steps == 0:
            return {}
        step_s = self._step_s
        if self._events:  # a log step: the record's host read has already synced the stream
            self._spans[-1][1].synchronize()
            step_s = sum(s.elapsed_time(e) for s, e in self._spans) / 1e3
        busy = max(0.0, step_s - seconds(self._wait_host_s, self._wait_spans)) / self._steps
        self._spans, self._step_s, self._steps = [], 0.0, 0
        self._wait_host_s, self._wait_spans = 0.0, []
        world = self.grid.world_group
        everyone = torch.zeros(world.size, dtype=torch.float64, device=self.device)
        C.all_gather(everyone, torch.tensor([busy], dtype=torch.float64, device=self.device), world)
        per_rank = host_sync.read(everyone, "stragglers", placeholder=[busy] * world.size)
        per_rank = per_rank if isinstance(per_rank, list) else [per_rank]
        median = statistics.median(per_rank)
        slow = [r for r, b in enumerate(per_rank) if median > 0 and b > self.factor * median]
        self.message = "; ".join(
            f"rank {r} busy {per_rank[r]:.3g} s a step, {per_rank[r] / median:.1f}x the median "
            f"{median:.3g} s" for r in slow)
        if self.message and self.grid.rank == 0:
            print(f"[zerotron] straggler: {self.message} (busy: a step's time less the time "
                  f"blocked in communication; logging.straggler_factor={self.factor})", flush=True)
        return {"busy_s_median": median, "busy_s_max": max(per_rank), "straggler_ranks": slow}
