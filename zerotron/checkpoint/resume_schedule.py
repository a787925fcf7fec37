"""What a resume may change of the learning-rate schedule: nothing, unless the user says so.

Why: a checkpoint continues its run only along the rates it was trained with. As Megatron's
``check_checkpoint_args`` / ``OptimizerParamScheduler`` do, a changed rate, warm-up, decay,
global batch or seed (``SCHEDULE``) is refused unless ``checkpoint.override_schedule=true``.
``training.train_steps`` is one of these only where a decay ends at it (``optimizer.schedule_steps``
unset): a resume with another ``train_steps`` re-stretched the decay in silence (issue 46: lr
6.95e-4 at step 6 jumped to 2.07e-3 at step 7). It is refused when the steps already trained
would have run at other rates under this run's schedule; when they would not (the decay had not
begun) the resumed run is the run this command would have trained from scratch, and it goes on.
"""

from __future__ import annotations

from typing import Any

SCHEDULE = ("optimizer.lr", "optimizer.min_lr", "optimizer.warmup_steps", "optimizer.decay",
            "optimizer.schedule", "optimizer.warmup_min_lr", "optimizer.warmup_type",
            "optimizer.schedule_steps", "training.global_batch_size", "training.seed")
DECAY_END = "optimizer.schedule_steps"
TRAIN_STEPS = "training.train_steps"


def decay_end(flat: dict[str, Any]) -> Any:
    """Where a flattened config's decay ends: ``optimizer.schedule_steps``, which unset means
    ``training.train_steps`` -- so ``--optimizer.schedule_steps 8`` is the same schedule as an
    unset one with ``train_steps`` 8, and keeping a checkpoint's schedule needs no override."""
    end = flat.get(DECAY_END)
    return end if end is not None else flat.get(TRAIN_STEPS)


def is_schedule(key: str) -> bool:
    return key in SCHEDULE or key == TRAIN_STEPS


def restretched(meta: dict, saved: dict[str, Any], cfg) -> tuple[tuple[str, Any, Any], str] | None:
    """``((field, checkpoint's value, this run's), why)`` when this run's ``training.train_steps``
    moves the end of a decay the checkpoint's steps were trained along, else None.

    The last trained update decides for all of them: before the decay both schedules give the
    warm-up's rates, and past its start the decay's progress ``(s - warmup) / (end - warmup)``
    differs at every step once it differs at one."""
    from zerotron.zero.lr_schedule import lr_at

    o, old, new = cfg.optimizer, saved.get(TRAIN_STEPS), cfg.training.train_steps
    if o.schedule_steps is not None or not isinstance(old, int) or old == new:
        return None  # the decay ends at schedule_steps (compared as a SCHEDULE field) or the same
    updates = int(meta.get("adam_step", meta["step"]))
    if updates < 1:
        return None
    last = updates - 1  # the last update the checkpoint holds, 0-based as lr_at counts
    was, now = lr_at(last, o, old), lr_at(last, o, new)
    if was == now:
        return None
    why = (f"its update {updates} ran at lr {was:.3g}, which a {o.decay} decay over {new} steps "
           f"puts at {now:.3g}")
    return (TRAIN_STEPS, old, new), why


def refusal(asked: str, path, fields: str, stretch: tuple[Any, str] | None) -> str:
    """The refusal of a resume that would change its run's schedule (``fields``: the changes);
    ``stretch``: the checkpoint's ``train_steps`` and why, when that is one of them."""
    keep = "" if stretch is None else (
        f" ({stretch[1]}); to train on along the checkpoint's decay pass "
        f"--optimizer.schedule_steps {stretch[0]}")
    return (f"{asked}: resuming {path} would change its run's schedule: {fields}{keep}; keep the "
            f"checkpoint's values, or pass --checkpoint.override_schedule true to continue with "
            f"this run's")
