"""Data-parallel, resumable sampler: which dataset samples each DP rank reads at each micro-step.

Why this layout: the global batch that starts at ``c`` consumed samples is *defined* as samples
``[c, c + G)`` of the (already shuffled) dataset, independent of how many DP ranks share it.
Rank ``r`` of ``dp_size`` takes the contiguous slice ``[c + r * G / dp_size, c + (r + 1) * G /
dp_size)`` and cuts it into micro-batches of ``micro_batch_size``. So the union over ranks and
micro-steps -- hence the averaged gradient (ZeRO's DP all-reduce / reduce-scatter) -- is the same
for DP = 1 and DP = 4, and resuming at any ``consumed_samples`` continues exactly where an
uninterrupted run would be: also with another global batch size (``checkpoint.override_schedule``),
whose first batch starts at the checkpoint's count even when that count is not a multiple of the
new size. Samples past the last full global batch are not used.
"""

from __future__ import annotations

from typing import Iterator


class PretrainSampler:
    """Iterate over lists of sample indices, one list per micro-batch of this DP rank."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 global_batch_size: int, dp_rank: int, dp_size: int):
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(total_samples > 0, f"total_samples must be positive, got {total_samples}")
        need(micro_batch_size > 0, f"micro_batch_size must be positive, got {micro_batch_size}")
        need(dp_size > 0, f"dp_size must be positive, got {dp_size}")
        need(0 <= dp_rank < dp_size, f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
        need(global_batch_size > 0 and global_batch_size % (micro_batch_size * dp_size) == 0,
             f"global_batch_size {global_batch_size} must be a positive multiple of micro_batch_size"
             f" x dp_size = {micro_batch_size} x {dp_size}; adjust global_batch_size")
        need(consumed_samples >= 0, f"consumed_samples must be >= 0, got {consumed_samples}")
        need(consumed_samples <= total_samples,
             f"consumed_samples {consumed_samples} exceeds total_samples {total_samples}; the run "
             f"is already complete or total_samples shrank")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.global_batch_size = micro_batch_size, global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per global batch on each DP rank (gradient accumulation steps)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    @property
    def remaining_steps(self) -> int:
        return (self.total_samples - self.consumed_samples) // self.global_batch_size

    def __len__(self) -> int:
        return self.remaining_steps * self.num_micro_batches

    def global_batch(self, step: int) -> list[int]:
        """All sample indices of the ``step``-th global batch from ``consumed_samples`` (what every
        DP size must agree on)."""
        start = self.consumed_samples + step * self.global_batch_size
        return list(range(start, start + self.global_batch_size))

    def __iter__(self) -> Iterator[list[int]]:
        per_rank = self.global_batch_size // self.dp_size
        for step in range(self.remaining_steps):
            base = self.consumed_samples + step * self.global_batch_size + self.dp_rank * per_rank
            for m in range(self.num_micro_batches):
                start = base + m * self.micro_batch_size
                yield list(range(start, start + self.micro_batch_size))
