"""Run scripts/pretrain_gpt.py's ``main`` on forked gloo ranks (tests/harness.py) with a fault armed."""

from __future__ import annotations

import contextlib
import io
import os
import time

import torch  # noqa: F401 - imported once here, not in every forked rank (start-up dominates)
import zerotron.training.trainer  # noqa: F401

from scripts.pretrain_gpt import main as pretrain_main
from tests.harness import Ranks
from zerotron.config.cli import last_wins

TINY = ["--config", "configs/tiny.yaml", "--tp", "1", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--seq-length", "32", "--log-interval", "1", "--eval-interval", "0", "--wandb-mode", "disabled",
        "--optimizer.warmup_steps", "2", "--save", "none"]


def tiny(cache: str) -> list[str]:
    """``TINY`` with its data cache (corpus, sample indices) in ``cache``, not in the checkout."""
    return TINY + ["--data.cache_dir", cache]


def _main(argv: list[str], env: dict[str, str]) -> tuple[int, str, str, float]:
    os.environ.update(env)
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = pretrain_main(last_wins(argv))  # a test's flags override TINY's
    return code, out.getvalue(), err.getvalue(), time.monotonic() - start


def start(argv: list[str], world: int = 2, fault: str = "", env: dict | None = None, may_die=(),
          collective_timeout: float = 20.0) -> Ranks:
    """The job ``run`` waits for, started: for drills that overlap their waits (``tests.harness.Overlap``)."""
    env = {"ZEROTRON_FAULT": fault, **(env or {})}
    return Ranks(_main, world, argv, env, may_die=may_die, collective_timeout=collective_timeout)


def run(argv: list[str], world: int = 2, fault: str = "", env: dict | None = None, may_die=(),
        collective_timeout: float = 20.0, timeout: float = 55.0):
    """Per rank ``(exit code, stdout, stderr, seconds)``, or None for a rank in ``may_die`` that died."""
    with start(argv, world, fault, env, may_die, collective_timeout) as ranks:
        return ranks.wait(timeout)


def forbid_process_group(monkeypatch) -> None:
    """Make ``init_distributed`` fail the run if it is reached (forked ranks inherit the patch): a
    refusal that must come at start-up is held by this mechanism, not by a clock."""
    import zerotron.parallel

    def reached(*args, **kwargs):
        raise AssertionError("the run reached init_distributed: it was not refused at start-up")

    monkeypatch.setattr(zerotron.parallel, "init_distributed", reached)
