"""Learning-rate schedule: warm-up, then cosine, linear or no decay -- Megatron's or DeepSpeed's.

A pure function of the number of optimizer updates applied (``ZeroOptimizer.updates``, saved
with the optimizer's state), so a resumed run needs to store nothing more. An fp16 step skipped
for overflow is not an update and does not advance the schedule -- DeepSpeed and Megatron step
their schedulers only after an update.

Two families (``optimizer.schedule``), because a DeepSpeed JSON must train at the learning rates
DeepSpeed would use, step for step:

* ``megatron``: step ``s`` (0-based) warms up linearly from ``warmup_min_lr`` to ``lr`` over
  ``warmup_steps`` (``lr * (s + 1) / warmup_steps`` when ``warmup_min_lr`` is 0), then decays to
  ``min_lr`` at ``schedule_steps`` (default ``training.train_steps``, Megatron's
  ``--lr-decay-iters``). The decay is Megatron's step for step; the warm-up is one step ahead of
  it: Megatron's ``OptimizerParamScheduler`` runs step ``s`` at ``s / warmup_steps``, so its first
  update is at ``warmup_min_lr`` (0 by default) and teaches the model nothing.
* ``deepspeed``: DeepSpeed's ``lr_schedules`` (``WarmupLR`` = decay ``constant``,
  ``WarmupDecayLR`` = ``linear``, ``WarmupCosineLR`` = ``cosine``). DeepSpeed sets the rate at
  construction and advances the scheduler *after* each optimizer step, so step ``s`` runs at the
  scheduler's iteration ``s - 1``: the first step at ``warmup_min_lr`` (0 for ``WarmupCosineLR``,
  whose constructor returns a ratio of 0), the second at iteration 0. The warm-up is ``log``
  (DeepSpeed's default: ``log(it + 1) / log(W)``) or ``linear`` (``it / W``) over
  ``W = max(2, warmup_steps)`` iterations, as DeepSpeed clamps it.
* ``onecycle``: DeepSpeed's ``OneCycle`` (Smith's 1cycle policy, arXiv 1803.09820), with the same
  one-iteration offset: the rate climbs linearly from ``warmup_min_lr`` to ``lr`` over
  ``warmup_steps`` iterations, falls back over ``cycle_down_steps`` (default ``warmup_steps``),
  then ``warmup_min_lr / (1 + decay_lr_rate * d / decay_step_size)`` at ``d`` iterations after the
  cycle (constant when either is 0). With ``cycle_momentum`` Adam's beta1 moves the other way,
  from ``beta1`` down to ``cycle_min_beta1`` and back, then grows by ``decay_beta1_rate``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, get_args

Decay = Literal["cosine", "linear", "constant"]  # the types of the optimizer section's fields
LrScheduleFamily = Literal["megatron", "deepspeed", "onecycle"]
WarmupType = Literal["linear", "log"]
DECAYS, SCHEDULES, WARMUP_TYPES = get_args(Decay), get_args(LrScheduleFamily), get_args(WarmupType)


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


def one_cycle(step: int, o) -> tuple[float, float]:
    """DeepSpeed's ``OneCycle``: (rate, beta1) of optimizer step ``step`` (0-based) under the
    ``optimizer`` section ``o``; beta1 is ``o.beta1`` throughout unless ``o.cycle_momentum``."""
    it, lo, hi = step - 1, o.warmup_min_lr, o.lr
    top, bottom = o.beta1, (o.cycle_min_beta1 if o.cycle_momentum else o.beta1)
    if it < 0:  # what the scheduler's constructor sets: the low rate, the low momentum
        return lo, bottom
    up = float(o.warmup_steps)
    total = up + float(o.cycle_down_steps if o.cycle_down_steps is not None else o.warmup_steps)
    if it < total:
        cycle = math.floor(1 + (it + 1) / total)
        x = 1.0 + (it + 1) / total - cycle  # position within the cycle, DeepSpeed's expression to the bit
        ratio = up / total
        height = x / ratio if x <= ratio else (x - 1) / (ratio - 1)
        return lo + (hi - lo) * height, top - (top - bottom) * height
    if o.decay_step_size == 0:
        return lo, top
    interval = (it - total + 1) / o.decay_step_size
    return lo / (1 + o.decay_lr_rate * interval), (top * (1 + o.decay_beta1_rate * interval) if o.cycle_momentum
                                                   else top)


def betas_at(step: int, optimizer) -> tuple[float, float]:
    """Adam's (beta1, beta2) for step ``step``: the section's, or OneCycle's cycled beta1."""
    o = optimizer
    if o.schedule == "onecycle" and o.cycle_momentum:
        return one_cycle(step, o)[1], o.beta2
    return o.beta1, o.beta2


def lr_at(step: int, optimizer, train_steps: int) -> float:
    """The rate of step ``step`` under a run's ``optimizer`` section (``config.run_config.OptimizerSection``)."""
    o = optimizer
    if o.schedule == "onecycle":
        return one_cycle(step, o)[0]
    total = o.schedule_steps if o.schedule_steps is not None else train_steps
    if o.schedule == "deepspeed":
        return deepspeed_learning_rate(step, lr=o.lr, min_lr=o.min_lr, warmup_min_lr=o.warmup_min_lr,
                                       warmup_steps=o.warmup_steps, total_steps=total, decay=o.decay,
                                       warmup_type=o.warmup_type)
    return learning_rate(step, lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps, total_steps=total,
                         decay=o.decay, warmup_min_lr=o.warmup_min_lr)


def min_lr_used(optimizer) -> bool:
    """Whether the schedule reads ``min_lr``: only a linear or cosine decay ends there. OneCycle's
    floor is ``warmup_min_lr`` and a constant one (DeepSpeed's ``WarmupLR``) stays at ``lr``, so a
    ``min_lr`` above ``lr`` contradicts nothing there."""
    return optimizer.schedule != "onecycle" and optimizer.decay != "constant"


def check_schedule(optimizer) -> None:
    """Raise ``ValueError`` naming ``optimizer.<field>``, the value and the fix (``RunConfig.validate``)."""
    o = optimizer
    if o.schedule not in SCHEDULES:
        raise ValueError(f"optimizer.schedule={o.schedule!r} is not one of {list(SCHEDULES)} (deepspeed: "
                         f"DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR; onecycle: its OneCycle)")
    if o.warmup_type not in WARMUP_TYPES:
        raise ValueError(f"optimizer.warmup_type={o.warmup_type!r} is not one of {list(WARMUP_TYPES)}")
    if o.warmup_type == "log" and o.schedule != "deepspeed":
        raise ValueError("optimizer.warmup_type='log' is DeepSpeed's warm-up; set optimizer.schedule=deepspeed "
                         "or use warmup_type=linear")
    if o.schedule == "onecycle" and not (isinstance(o.warmup_steps, int) and o.warmup_steps >= 1):
        raise ValueError(f"optimizer.warmup_steps={o.warmup_steps!r}: OneCycle needs a positive "
                         f"cycle_first_step_size (its cycle would have no length)")
    if o.schedule == "onecycle":
        _check_one_cycle(o)
        return
    _refuse_one_cycle_fields(o)
    if not (isinstance(o.warmup_min_lr, (int, float)) and 0 <= o.warmup_min_lr <= o.lr):
        raise ValueError(f"optimizer.warmup_min_lr={o.warmup_min_lr!r} must be between 0 and optimizer.lr={o.lr}")
    n = o.schedule_steps
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"optimizer.schedule_steps={n!r} must be a positive number of steps, or null for "
                         f"training.train_steps")


ONE_CYCLE_FIELDS = ("cycle_down_steps", "decay_lr_rate", "decay_step_size", "cycle_momentum", "cycle_min_beta1",
                    "decay_beta1_rate")
# the other schedules' fields, and what stands for each under OneCycle
OTHER_SCHEDULES_FIELDS = {"min_lr": "its floor is optimizer.warmup_min_lr",
                          "decay": "it decays by optimizer.decay_lr_rate / decay_step_size",
                          "schedule_steps": "its length is warmup_steps + cycle_down_steps"}


def field_default(optimizer, name: str):
    """The optimizer section's default for ``name``: a field left there is a field not set."""
    (field,) = [f for f in dataclasses.fields(optimizer) if f.name == name]
    return field.default


def _refuse_one_cycle_fields(o) -> None:
    """A OneCycle field set under another schedule would be accepted and ignored: refuse it."""
    for name in ONE_CYCLE_FIELDS:
        if getattr(o, name) != field_default(o, name):
            raise ValueError(f"optimizer.{name}={getattr(o, name)!r} applies to optimizer.schedule=onecycle only "
                             f"(this run's is {o.schedule!r}); set optimizer.schedule=onecycle or remove it")


def _check_one_cycle(o) -> None:
    """OneCycle's fields; its low rate may exceed its high one (DeepSpeed allows an inverted cycle).
    The other schedules' fields would be accepted and ignored here: they are refused instead."""
    for name, instead in OTHER_SCHEDULES_FIELDS.items():
        default = field_default(o, name)
        if getattr(o, name) != default:
            unset = "null" if default is None else default
            raise ValueError(f"optimizer.{name}={getattr(o, name)!r} has no effect under optimizer.schedule=onecycle "
                             f"({instead}); remove it from the config or pass --optimizer.{name} {unset} (its "
                             f"default), or choose another schedule")
    for name in ("warmup_min_lr", "decay_lr_rate", "decay_beta1_rate"):
        value = getattr(o, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"optimizer.{name}={value!r} must be a number >= 0 (schedule onecycle)")
    for name in ("cycle_down_steps", "decay_step_size"):
        value = getattr(o, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"optimizer.{name}={value!r} must be a whole number of steps >= 0 (schedule onecycle)")
    if not isinstance(o.cycle_momentum, bool):
        raise ValueError(f"optimizer.cycle_momentum={o.cycle_momentum!r} must be true or false")
    if o.cycle_momentum and not 0 <= o.cycle_min_beta1 < 1:
        raise ValueError(f"optimizer.cycle_min_beta1={o.cycle_min_beta1!r} must be in [0, 1) (the cycle's lowest "
                         f"beta1; optimizer.beta1 is its highest)")
