"""``--profile-steps A B``: a ``torch.profiler`` trace of steps A to B of each rank, in the run dir.

What a cluster run's operators, kernels and collectives did in a few steps is otherwise invisible:
the trace (Chrome trace-event JSON) opens in Perfetto (ui.perfetto.dev) and in TensorBoard's
profiler plugin, one file per rank (``<run_dir>/profile/rank_<r>.pt.trace.json``), each step a
``ProfilerStep#<n>`` span. On CUDA the allocator's history over those steps is dumped beside it
(``rank_<r>.memory.pickle``) for PyTorch's memory viewer (pytorch.org/memory_viz), which shows
which tensors held the peak.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch


class StepProfiler:
    """Profiles steps ``first`` to ``last`` (1-based, inclusive) of ``steps = [first, last]``; an
    empty ``steps`` profiles nothing and costs nothing."""

    def __init__(self, steps: list[int], run_dir: str | Path, rank: int, device: torch.device):
        self.first, self.last = (steps[0], steps[1]) if steps else (0, -1)
        self.dir, self.rank, self.device = Path(run_dir) / "profile", rank, device
        self.prof = None
        self.trace: Path | None = None

    @contextlib.contextmanager
    def step(self, step: int):
        """Around step ``step``: the profiler starts before ``first``; the trace is written after
        ``last``."""
        if step == self.first:
            self._start()
        yield
        if self.prof is not None:
            if step == self.last:
                self._stop()
            else:
                self.prof.step()  # closes this step's ProfilerStep span and opens the next one's

    def _start(self) -> None:
        from torch.profiler import ProfilerAction, ProfilerActivity, profile

        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        if cuda:  # the allocator's events from here on, for the memory viewer
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        # a schedule (every step recorded) is what makes the profiler mark ProfilerStep#<n> spans
        self.prof = profile(activities=activities, schedule=lambda _: ProfilerAction.RECORD,
                            record_shapes=True, profile_memory=True)
        self.prof.step_num = self.first  # ProfilerStep#<n> carries the training step's number
        self.prof.__enter__()

    def _stop(self) -> None:
        self.prof.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.trace = self.dir / f"rank_{self.rank}.pt.trace.json"
        self.prof.export_chrome_trace(str(self.trace))
        if self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(self.dir / f"rank_{self.rank}.memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        self.prof = None
