"""Megatron-LM's tensor-parallel region boundaries as autograd functions.

Megatron-LM §3 (Code 1, Fig. 3) builds every tensor-parallel layer from two conjugate operators:

* **f** (``copy_to_tp_region``): identity forward, all-reduce backward. It sits where a
  replicated activation enters a column-parallel GEMM: every rank uses the whole input, so each
  rank's input gradient is only a partial sum of the true gradient.
* **g** (``reduce_from_tp_region``): all-reduce forward, identity backward. It sits after a
  row-parallel GEMM whose ranks each hold a partial sum of the output.

With f before the column-parallel GEMM and g after the row-parallel one, an MLP or attention
block costs one all-reduce forward and one backward; a transformer block costs two of each.

``gather_from_tp_region`` / ``scatter_to_tp_region`` move between a tensor split along its last
dimension and the whole tensor (each other's backward). They are used only when a caller asks a
layer for gathered output or gives it an unsplit input; the GPT never needs them on its hot path.

All communication goes through ``zerotron.parallel.collectives`` so it is counted per group.
Both all-reduces work in place, as Megatron's ``_reduce`` does, so neither makes a b×s×h copy:
g's input is the fresh output of the row-parallel GEMM (or the masked embedding lookup), which
no other op saved (``mark_dirty`` tells autograd, which then refuses a caller that did save it),
and f's incoming gradient is the fresh input gradient of the column-parallel GEMM its output
feeds. That is f's contract: its output feeds one GEMM (or other op whose backward makes a new
gradient), never a residual add whose backward would hand the same gradient to a second branch.
Every use in zerotron keeps it. g's caller sees its tensor summed, as with Megatron; a view or a
leaf that wants a gradient (autograd forbids writing those) is reduced in a copy instead.
"""

from __future__ import annotations

import torch

from zerotron.parallel import collectives as C
from zerotron.parallel.grid import Group


def _all_reduce_(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduce ``x`` in place (a non-contiguous ``x`` is reduced in its contiguous copy). The
    backend sees a detached alias: its work object may outlive the call on a worker thread, and
    must not keep the autograd graph behind ``x`` alive with it."""
    x = x.contiguous()
    C.all_reduce(x.detach(), group)
    return x


def _reducible_in_place(x: torch.Tensor) -> bool:
    """A tensor autograd lets g overwrite: contiguous, not a view, not a leaf that wants a gradient."""
    return x.is_contiguous() and not x._is_view() and not (x.is_leaf and x.requires_grad)


def _split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group.size == 1:
        return x
    last = x.shape[-1]
    if last % group.size:
        raise ValueError(f"cannot split last dimension {last} over {group.size} TP ranks: not divisible")
    rank = group.rank_of(_global_rank())
    return x.chunk(group.size, dim=-1)[rank].contiguous()


def _gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group.size == 1:
        return x
    out = x.new_empty(group.size * x.numel())  # flat: gloo wants dim 0 = size * input dim 0
    C.all_gather(out, x.contiguous().view(-1), group)
    return torch.cat(out.view(group.size, *x.shape).unbind(0), dim=-1)


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


class _CopyToTPRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward (Megatron-LM §3)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce_(grad, ctx.group), None


class _ReduceFromTPRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward (Megatron-LM §3)."""

    @staticmethod
    def forward(ctx, x, group):
        if _reducible_in_place(x):  # the GEMM's fresh output: reduce it where it is
            ctx.mark_dirty(x)
            return _all_reduce_(x, group)
        return _all_reduce_(x.contiguous() if not x.is_contiguous() else x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTPRegion(torch.autograd.Function):
    """Keep this rank's chunk of the last dimension; backward gathers the chunks."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromTPRegion(torch.autograd.Function):
    """Concatenate every rank's chunk along the last dimension; backward keeps this rank's chunk."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


def copy_to_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron's f; a no-op (and no autograd node) when the TP group has one member."""
    return x if group.size == 1 else _CopyToTPRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron's g (reduces ``x`` itself where autograd allows it); a no-op on one member."""
    return x if group.size == 1 else _ReduceFromTPRegion.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Split the last dimension over TP ranks and keep this rank's chunk."""
    return x if group.size == 1 else _ScatterToTPRegion.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather the last dimension from every TP rank (rank order)."""
    return x if group.size == 1 else _GatherFromTPRegion.apply(x, group)
