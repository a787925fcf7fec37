"""When the ranks agree on a SIGTERM stop: at steps that read the host anyway, else within a bound.

SIGTERM reaches ranks at different steps (or one rank only), so they must agree to stop at the
same step: a world all-reduce of a flag and a host read of it (``Trainer._stop_agreed``). Made
every step, as Megatron-LM's exit-signal handler does, that read drains the device queue once a
step and the all-reduce waits for the slowest rank: on a GPU it takes away the host's lead over
the device that a step without host reads keeps (``host_sync``).

So the agreement is made only where a host read happens anyway -- a log, eval or save step, the
last step, a step with a background save in flight (whose commit it decides) -- and otherwise
once per ``bound_s`` seconds of training, counted in steps: the agreement also carries each
rank's mean step time since the last one (all-reduced with max, so every rank derives the same
number of steps to the next agreement from the same value). A stop is then noticed at most
``bound_s`` (10 s) of training after the signal: SLURM's ``--signal=TERM@120`` in our sbatch
script (or the ~90 s a preemptible cluster gives) leaves the rest for the checkpoint, and even
SLURM's default 30 s ``KillWait`` leaves 20 s. At 1 s a step that is one agreement per 10 steps
instead of every step; at 100 ms one per 100.
"""

from __future__ import annotations

import time

import torch

from zerotron.parallel import collectives as C
from zerotron.parallel import host_sync
from zerotron.training.step_events import evaluates, logs, saves

MAX_STEPS_BETWEEN = 10_000  # a dry run's placeholder step time of 0 s: still agree now and then


class StopCadence:
    """Counts steps since the last agreement and says when the next one is due (the same on
    every rank)."""

    def __init__(self, bound_s: float = 10.0, clock=time.perf_counter):
        self.bound_s, self.clock = bound_s, clock
        self.every = 1  # no step time measured yet: agree after the first step
        self.since = 0
        self.started = clock()

    def due(self, host_read_step: bool) -> bool:
        """Call once per step, on every rank with the same ``host_read_step`` (the step reads the
        host anyway): whether this step makes the agreement."""
        self.since += 1
        return host_read_step or self.since >= self.every

    def step_seconds(self) -> float:
        """This rank's mean step time since the last agreement (sent in the agreement, max over
        ranks)."""
        return (self.clock() - self.started) / max(self.since, 1)

    def agree(self, world_group, device, stop: float, writing: bool | None) -> list[float]:
        """The agreement: ``[stop, slowest step s, writing]`` maxed over the world and read
        (``"stop"``);
        ``writing`` only while a background save is in flight (None: no such entry)."""
        flag = [stop, self.step_seconds()] + ([] if writing is None else [float(writing)])
        flag = torch.tensor(flag, dtype=torch.float64, device=device)
        C.all_reduce(flag, world_group, op="max")
        got = host_sync.read(flag, "stop", placeholder=[0.0] * flag.numel())
        self.agreed(got[1])
        return got

    def agreed(self, slowest_step_s: float) -> None:
        """After an agreement: the next is due ``bound_s`` of the slowest rank's steps from now."""
        steps = self.bound_s / slowest_step_s if slowest_step_s > 0 else MAX_STEPS_BETWEEN
        self.every = max(1, min(MAX_STEPS_BETWEEN, int(steps)))
        self.since, self.started = 0, self.clock()


def host_read_step(cfg, step: int, writing: bool) -> bool:
    """Whether ``step`` reads the host anyway (``step_events``): a log, eval or save step, the
    last step, or a background save in flight, whose commit the agreement decides."""
    return writing or logs(cfg, step) or evaluates(cfg, step) or saves(cfg, step)
