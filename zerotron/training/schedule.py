"""Learning-rate schedule: linear warm-up, then cosine or linear decay to ``min_lr`` (Megatron style).

A pure function of the step, so a resumed run needs to store nothing but the step.
"""

from __future__ import annotations

import math


def learning_rate(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int, decay: str) -> float:
    """The learning rate for optimizer step ``step`` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if decay == "constant" or total_steps <= warmup_steps:
        return lr
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if decay == "linear":
        return lr - (lr - min_lr) * progress
    if decay == "cosine":
        return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"optimizer.decay={decay!r} is not one of ['cosine', 'linear', 'constant']")
