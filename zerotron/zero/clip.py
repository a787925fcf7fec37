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
carries the squared norm of the gradients the norm skips (``global_norm``), so an inf/NaN in
any local gradient -- a replicated LayerNorm on TP rank 1, the tied copy on the last stage -- makes
the step non-finite on every rank and every rank skips it together. Were the skipped gradients
left out, such an inf would reach AdamW on that rank alone and split its replicas apart.

Nothing here reads a device value: the norm, the finiteness flag and the clipping coefficient
stay 0-dim tensors (``zerotron.parallel.host_sync``), so a bf16/fp32 step queues its update
without waiting for the GPU. Only fp16's skip decision is read, by the optimizer.
"""

from __future__ import annotations

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
        views = [shard.narrow(0, a, b - a) for a, b in segments]
        if views:
            norms = torch._foreach_norm(views, 2, dtype=dtype)
            total = total + torch.stack(norms).pow(2).sum()
    return total


def global_norm(counted: torch.Tensor, uncounted: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """One all-reduce of ``[counted, uncounted]`` squared norms over ``group``; returns, on the
    device, the global norm of the counted gradients and whether *every* local gradient was finite.

    Both are 0-dim tensors (the norm in float64), so the step reads nothing: only fp16 needs the
    overflow decision on the host (``ZeroOptimizer.step``). A non-finite norm is the non-finite
    sum itself (inf or NaN); an inf/NaN only in the uncounted gradients makes the norm that value.
    float64 keeps the arithmetic of a host-side ``math.sqrt`` exactly (IEEE sqrt and division are
    correctly rounded in both), so the clipped gradients are bit for bit those of a Python float."""
    both = torch.stack([counted, uncounted])
    C.all_reduce(both, group)
    total, other = both.to(torch.float64).unbind()
    finite_total = torch.isfinite(total)
    finite = finite_total & torch.isfinite(other)
    norm = torch.where(finite_total, torch.where(finite, total.sqrt(), other), total)
    return norm, finite


def clip_coef(norm: torch.Tensor, max_norm: float | None, scale: float = 1.0) -> torch.Tensor | float:
    """The factor the gradients are multiplied by: unscaling (``1 / scale``) and
    torch.nn.utils.clip_grad_norm_'s ``max_norm / (norm + 1e-6)`` clamped to 1.

    A device tensor when clipping is on (it depends on the norm; no host read), else the Python
    float ``1 / scale`` -- known on the host, and ``1.0`` lets the state skip the multiply."""
    if not max_norm or max_norm <= 0:
        return 1.0 / scale
    # new_full + div_, not ``max_norm / t``: Tensor.__rtruediv__ is reciprocal() * max_norm
    coef = norm.new_full((), float(max_norm)).div_(norm + 1e-6).clamp_(max=1.0)
    return coef / scale if scale != 1.0 else coef


def apply_coef(grad: torch.Tensor, coef: torch.Tensor | float) -> torch.Tensor:
    """``grad *= coef`` in place, skipped only for a host-known 1.0 (``x * 1`` is exact anyway).

    A coefficient on another device than ``grad`` (the GPU norm of a CPU-offloaded state) must be
    moved by the caller once per step (``optimizer_state.coef_for``): a per-chunk copy would sync
    per chunk."""
    if isinstance(coef, torch.Tensor) or coef != 1.0:
        grad.mul_(coef)
    return grad
