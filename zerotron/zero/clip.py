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

The same all-reduce is the fp16 overflow check: an inf/NaN on any rank makes the sum non-finite
on every rank, so every rank skips the step together.
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


def global_norm(sq: torch.Tensor, group) -> float:
    """All-reduce the squared norm over ``group``; returns the norm (inf/nan on overflow)."""
    C.all_reduce(sq, group)
    value = float(sq)
    return math.sqrt(value) if math.isfinite(value) else value


def clip_coef(norm: float, max_norm: float | None) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), clamped to 1."""
    if not max_norm or max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))
