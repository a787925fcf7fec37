"""Which steps of the loop log, evaluate and save: one answer for the loop (``trainer.py``) and
for the SIGTERM agreement (``stop_cadence.py``), which agrees at the steps that read the host
anyway -- were the two to answer apart, a stop would be agreed at steps that read nothing more,
or missed at those that do."""

from __future__ import annotations


def logs(cfg, step: int) -> bool:
    """A log line (and the host read of its loss): every ``logging.log_interval`` and the last."""
    return step % cfg.logging.log_interval == 0 or step == cfg.training.train_steps


def evaluates(cfg, step: int) -> bool:
    """An evaluation, where the run has eval data: every ``logging.eval_interval`` (0: none)."""
    interval = cfg.logging.eval_interval
    return bool(interval and step % interval == 0)


def saves(cfg, step: int) -> bool:
    """A checkpoint (also at a SIGTERM stop): every ``checkpoint.save_interval`` and the last."""
    c = cfg.checkpoint
    return bool(c.save) and (bool(c.save_interval and step % c.save_interval == 0)
                             or step == cfg.training.train_steps)
