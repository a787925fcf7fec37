"""Learning-rate schedule: warm-up, then cosine, linear or no decay -- Megatron's or DeepSpeed's.

A pure function of the step, so a resumed run needs to store nothing but the step.

Two families (``optimizer.schedule``), because a DeepSpeed JSON must train at the learning rates
DeepSpeed would use, step for step:

* ``megatron``: step ``s`` (0-based) warms up linearly from ``warmup_min_lr`` to ``lr`` over
  ``warmup_steps`` (``lr * (s + 1) / warmup_steps`` when ``warmup_min_lr`` is 0), then decays to
  ``min_lr`` at ``schedule_steps`` (default ``training.train_steps``, Megatron's
  ``--lr-decay-iters``).
* ``deepspeed``: DeepSpeed's ``lr_schedules`` (``WarmupLR`` = decay ``constant``,
  ``WarmupDecayLR`` = ``linear``, ``WarmupCosineLR`` = ``cosine``). DeepSpeed sets the rate at
  construction and advances the scheduler *after* each optimizer step, so step ``s`` runs at the
  scheduler's iteration ``s - 1``: the first step at ``warmup_min_lr`` (0 for ``WarmupCosineLR``,
  whose constructor returns a ratio of 0), the second at iteration 0. The warm-up is ``log``
  (DeepSpeed's default: ``log(it + 1) / log(W)``) or ``linear`` (``it / W``) over
  ``W = max(2, warmup_steps)`` iterations, as DeepSpeed clamps it.
"""

from __future__ import annotations

import math

DECAYS = ("cosine", "linear", "constant")
SCHEDULES = ("megatron", "deepspeed")
WARMUP_TYPES = ("linear", "log")


def learning_rate(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int, decay: str,
                  warmup_min_lr: float = 0.0) -> float:
    """Megatron's rate for optimizer step ``step`` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return warmup_min_lr + (lr - warmup_min_lr) * (step + 1) / warmup_steps
    if decay == "constant" or total_steps <= warmup_steps:
        return lr
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if decay == "linear":
        return lr - (lr - min_lr) * progress
    if decay == "cosine":
        return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"optimizer.decay={decay!r} is not one of {list(DECAYS)}")


def deepspeed_learning_rate(step: int, *, lr: float, min_lr: float, warmup_min_lr: float, warmup_steps: int,
                            total_steps: int, decay: str, warmup_type: str) -> float:
    """DeepSpeed's rate for optimizer step ``step`` (0-based): ``WarmupLR`` / ``WarmupDecayLR`` /
    ``WarmupCosineLR`` at iteration ``step - 1`` (``min_lr`` is where the decay ends: DeepSpeed's
    ``warmup_min_lr`` for ``WarmupDecayLR``, ``cos_min_ratio * lr`` for ``WarmupCosineLR``)."""
    it, warmup = step - 1, max(2, warmup_steps)
    if it < 0:  # the rate the scheduler's constructor sets
        return 0.0 if decay == "cosine" else warmup_min_lr
    if it < warmup:
        if warmup_type == "log":
            gamma = math.log(it + 1) / math.log(warmup)
        elif warmup_type == "linear":
            gamma = it / warmup
        else:
            raise ValueError(f"optimizer.warmup_type={warmup_type!r} is not one of {list(WARMUP_TYPES)}")
        return warmup_min_lr + (lr - warmup_min_lr) * gamma
    if decay == "constant":
        return warmup_min_lr + (lr - warmup_min_lr) * 1.0
    if decay == "linear":
        gamma = max(0.0, (total_steps - it) / max(1.0, total_steps - warmup))
        return min_lr + (lr - min_lr) * gamma
    if decay == "cosine":
        progress = min(1.0, (it - warmup + 1) / max(1, total_steps - warmup))
        return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * progress)) / 2
    raise ValueError(f"optimizer.decay={decay!r} is not one of {list(DECAYS)}")


def lr_at(step: int, optimizer, train_steps: int) -> float:
    """The rate of step ``step`` under a run's ``optimizer`` section (``training.config.OptimizerSection``)."""
    o = optimizer
    total = o.schedule_steps if o.schedule_steps is not None else train_steps
    if o.schedule == "deepspeed":
        return deepspeed_learning_rate(step, lr=o.lr, min_lr=o.min_lr, warmup_min_lr=o.warmup_min_lr,
                                       warmup_steps=o.warmup_steps, total_steps=total, decay=o.decay,
                                       warmup_type=o.warmup_type)
    return learning_rate(step, lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps, total_steps=total,
                         decay=o.decay, warmup_min_lr=o.warmup_min_lr)


def check_schedule(optimizer) -> None:
    """Raise ``ValueError`` naming ``optimizer.<field>``, the value and the fix (``RunConfig.validate``)."""
    o = optimizer
    if o.schedule not in SCHEDULES:
        raise ValueError(f"optimizer.schedule={o.schedule!r} is not one of {list(SCHEDULES)} (deepspeed: "
                         f"DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR)")
    if o.warmup_type not in WARMUP_TYPES:
        raise ValueError(f"optimizer.warmup_type={o.warmup_type!r} is not one of {list(WARMUP_TYPES)}")
    if o.warmup_type == "log" and o.schedule != "deepspeed":
        raise ValueError("optimizer.warmup_type='log' is DeepSpeed's warm-up; set optimizer.schedule=deepspeed "
                         "or use warmup_type=linear")
    if o.schedule == "deepspeed" and not (isinstance(o.warmup_steps, int) and o.warmup_steps >= 1):
        raise ValueError(f"optimizer.warmup_steps={o.warmup_steps!r}: DeepSpeed's schedules need a positive "
                         f"warmup_num_steps (it is clamped to at least 2)")
    if not (isinstance(o.warmup_min_lr, (int, float)) and 0 <= o.warmup_min_lr <= o.lr):
        raise ValueError(f"optimizer.warmup_min_lr={o.warmup_min_lr!r} must be between 0 and optimizer.lr={o.lr}")
    n = o.schedule_steps
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"optimizer.schedule_steps={n!r} must be a positive number of steps, or null for "
                         f"training.train_steps")
