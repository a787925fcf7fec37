"""A rank that is alive but slow is named at the log step (``training/stragglers.py``)."""

from __future__ import annotations

import os

from tests.harness import spawn
from tests.training.test_trainer import make_config


def run_with_slow_rank(run_dir, cache):
    import torch.distributed as dist

    from zerotron.parallel.runtime import init_distributed
    from zerotron.training.build_run import build_run
    from zerotron.training.trainer import Trainer

    os.environ.update(ZEROTRON_FAULT="slow@rank=1", ZEROTRON_FAULT_SLOW_S="0.4")
    cfg = make_config(run_dir, cache, "--train-steps", "4")
    last = Trainer(build_run(cfg.validate(dist.get_world_size()), init_distributed())).train()
    return {k: last[k] for k in ("straggler_ranks", "busy_s_median", "busy_s_max")}


def test_a_slowed_rank_is_named_as_a_straggler(zerotron_cache, tmp_path, capfd):
    """Rank 1 computes 0.4 s more at the start of every step: the step takes as long on rank 0, which
    waits for it in the gradient all-reduce, but rank 0's busy time stays small, so rank 1 alone
    is above 1.2x the median. (Mutation: the step's wall time in place of the thread's CPU time
    names no one.)"""
    out = spawn(run_with_slow_rank, 2, tmp_path / "run", zerotron_cache, timeout=240)
    for rank_out in out:  # every rank holds the same verdict
        assert rank_out["straggler_ranks"] == [1], rank_out
        assert rank_out["busy_s_max"] >= 0.4, rank_out
    assert "straggler: rank 1 busy" in capfd.readouterr().out
