"""The SIGTERM agreement costs a host read only where a step reads anyway, or once per bound.

Issue 41, item 8: a world all-reduce plus a host read every step drains a GPU's queue once a step.
``stop_cadence.StopCadence`` agrees at log/eval/save/last steps and with a background save in
flight, else once per ``bound_s`` of the slowest rank's steps. Here a clock that reads one second
per step makes the bound exactly 3 steps, so the stop a SIGTERM asks for after step 5 (rank 0
only) must come at step 7 on both ranks: not at 5 (an agreement every step, the old cost), not at
the run's end (no bound).
"""

from __future__ import annotations

from tests.harness import spawn
from zerotron.training.stop_cadence import MAX_STEPS_BETWEEN, StopCadence


def test_the_cadence_spaces_agreements_by_the_slowest_step():
    now = [0.0]
    cadence = StopCadence(bound_s=10.0, clock=lambda: now[0])
    assert cadence.due(False)  # nothing measured yet: the first step agrees
    now[0] = 2.0
    assert cadence.step_seconds() == 2.0
    cadence.agreed(2.5)  # another rank was slower: 10 s are 4 of its steps
    dues = []
    for _ in range(8):
        dues.append(cadence.due(False))
        if dues[-1]:
            cadence.agreed(2.5)
    assert dues == [False, False, False, True, False, False, False, True]
    assert cadence.due(True)  # a step that reads the host anyway always agrees
    cadence.agreed(0.0)  # a dry run's placeholder time
    assert cadence.every == MAX_STEPS_BETWEEN


def _sigterm_after_step_5(run_dir, cache):
    import os
    import signal

    import torch.distributed as dist

    from tests.training.test_trainer import make_config
    from zerotron.parallel import host_sync
    from zerotron.parallel.runtime import init_distributed
    from zerotron.training.trainer import Trainer
    from zerotron.training.build_run import build_run

    cfg = make_config(run_dir, cache, "--train-steps", "12", "--log-interval", "100",
                      "--eval-interval", "0",
                      "--save", "none").validate(dist.get_world_size())
    trainer = Trainer(build_run(cfg, init_distributed()))
    trainer.stop_cadence = StopCadence(bound_s=3.0, clock=lambda: float(trainer.step))  # 1 s a step
    step = trainer.train_step

    def preempted_step():
        out = step()
        if trainer.step == 5 and dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # one rank only: the rest learn it at an agreement
        return out

    trainer.train_step = preempted_step
    with host_sync.counting() as reads:
        trainer.train()
    return trainer.step, trainer.stopped, reads.by_reason.get("stop", 0)


def test_a_sigterm_between_agreements_stops_every_rank_within_the_bound(zerotron_cache, tmp_path):
    out = spawn(_sigterm_after_step_5, 2, tmp_path / "run", zerotron_cache, timeout=180)
    assert out == [(7, True, 3)] * 2, out  # agreements at steps 1, 4 and 7
