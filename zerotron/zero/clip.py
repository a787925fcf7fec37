"""Global gradient norm across DP, TP and PP, counting every parameter exactly once.

Under Pos/Pos+g/Pos+g+p each DP rank holds a disjoint shard of the reduced gradient, so the
squared norm is the sum over ranks of the squared norms of their shards: one all-reduce of one
number over the whole world (stage 0 holds the full reduced gradient everywhere, so it sums over
the model-parallel group only). Two kinds of parameter would be counted twice:

* TP-replicated parameters (``ShardInfo.tp_split_dim`` None: LayerNorm, biases of row-parallel
  layers, the position table) hold the same gradient on every TP rank -- counted on TP rank 0 only;
* the last pipeline stage's copy of the tied embedding (``ShardInfo.embedding_copy``) -- never
  counted.

A parameter without ``ShardInfo`` is an error (``zerotron.parallel.shard_info``): taking it for
replicated would silently drop a split weight's other TP slices from the norm.

The same all-reduce is the fp16 overflow check, but the check does *not* de-duplicate: it also
carries the squared norm of the gradients the norm skips (``norm_and_overflow``), so an inf/NaN in
any local gradient -- a replicated LayerNorm on TP rank 1, the tied copy on the last stage -- makes
the step non-finite on every rank and every rank skips it together. Were the skipped gradients
left out, such an inf would reach AdamW on that rank alone and split its replicas apart.
"""

from __future__ import annotations

import math

import torch

from zerotron.parallel import collectives as C
from zerotron.parallel.shard_info import shard_info


def counts_in_norm(param, tp_rank: int, name: str | None = None) -> bool:
    """Whether this TP rank's copy of ``param`` adds to the global norm (see the module docstring)."""
    info = shard_info(param, name)
    if info.embedding_copy:
        return False
    return not (info.replicated and tp_rank != 0)


def local_sq_norm(shards_and_segments, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sum of squares (in the master ``dtype``, on ``device``) over ``[(grad_shard, [(a, b), ...]), ...]``."""
    total = torch.zeros((), dtype=dtype, device=device)
    for shard, segments in shards_and_segments:
        views = [shard[a:b] for a, b in segments]
        if views:
            norms = torch._foreach_norm(views, 2, dtype=dtype)
            total = total + torch.stack(norms).pow(2).sum()
    return total


def norm_and_overflow(counted: torch.Tensor, uncounted: torch.Tensor, group) -> tuple[float, bool]:
    """One all-reduce of ``[counted, uncounted]`` squared norms over ``group``: the global norm of the
    counted gradients, and whether *any* local gradient was inf/NaN (then the norm is inf/NaN too)."""
    both = torch.stack([counted, uncounted])
    C.all_reduce(both, group)
    total, other = both.tolist()
    overflow = not (math.isfinite(total) and math.isfinite(other))
    if not math.isfinite(total):
        return total, True
    return (other if overflow else math.sqrt(total)), overflow


def clip_coef(norm: float, max_norm: float | None) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), clamped to 1."""
    if not max_norm or max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))
