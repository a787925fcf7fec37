"""Name a rank that is alive but slow: each rank's busy time per step, compared at every log step.

A slow rank (a throttled GPU, a noisy neighbour, a slow data read) hides in the step time,
because every collective makes the others wait for it; the heartbeat sees it alive. What tells
it apart is that it waits least. Busy time is, on a GPU, the step's time on the device clock
less the time its stream was blocked in communication (``parallel/wait_clock.py``); on the host,
the main thread's CPU time in the step (a blocked gloo wait uses none, and time lost to other
processes sharing the cores is not the rank's own slowness). It is gathered over the world at
each log step and a rank above ``logging.straggler_factor`` x the median is named, as
Megatron-LM's straggler detector names its slowest ranks. One all-gather of a float and one host
read per log interval (reason ``"stragglers"``); per step only clock reads (GPU: two events).
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
        self._events = device.type == "cuda" and not host_sync.simulated()
        self.clock.enabled = factor > 0 and self._events
        self._spans: list = []  # GPU: (start, end) events of each step of the window
        self._waits: list = []  # GPU: the spans its stream was blocked in those steps
        self._cpu_s, self._steps = 0.0, 0

    @contextlib.contextmanager
    def step(self):
        """Bracket one training step; waits outside steps (evaluation, saves) are not counted."""
        if self.factor <= 0:
            yield
            return
        if not self._events:
            start = time.thread_time()
            yield
            self._cpu_s += time.thread_time() - start
            self._steps += 1
            return
        self.clock.take()  # drop what was blocked between steps (evaluation, a save)
        start = host_sync.event(enable_timing=True)
        start.record()
        yield
        end = host_sync.event(enable_timing=True)
        end.record()
        self._spans.append((start, end))
        self._waits += self.clock.take()
        self._steps += 1

    def _busy_per_step(self) -> float:
        if not self._events:
            return self._cpu_s / self._steps
        self._spans[-1][1].synchronize()  # a log step: the record's host read already synced
        step_s = sum(s.elapsed_time(e) for s, e in self._spans) / 1e3
        return max(0.0, step_s - seconds(self._waits)) / self._steps

    def read(self) -> dict:
        """``busy_s_median``/``busy_s_max`` (seconds per step over the window) and
        ``straggler_ranks``; a rank above the factor is printed by rank 0."""
        if self.factor <= 0 or self._steps == 0:
            return {}
        busy = self._busy_per_step()
        self._spans, self._waits, self._cpu_s, self._steps = [], [], 0.0, 0
        world = self.grid.world_group
        everyone = torch.zeros(world.size, dtype=torch.float64, device=self.device)
        C.all_gather(everyone, torch.tensor([busy], dtype=torch.float64, device=self.device), world)
        per_rank = host_sync.read(everyone, "stragglers", placeholder=[busy] * world.size)
        per_rank = per_rank if isinstance(per_rank, list) else [per_rank]
        median = statistics.median(per_rank)
        slow = [r for r, b in enumerate(per_rank) if median > 0 and b > self.factor * median]
        verdict = "; ".join(
            f"rank {r} busy {per_rank[r]:.3g} s a step, {per_rank[r] / median:.1f}x the median "
            f"{median:.3g} s" for r in slow)
        if verdict and self.grid.rank == 0:
            print(f"[zerotron] straggler: {verdict} (busy: its own compute time in a step; "
                  f"logging.straggler_factor={self.factor})", flush=True)
        return {"busy_s_median": median, "busy_s_max": max(per_rank), "straggler_ranks": slow}
