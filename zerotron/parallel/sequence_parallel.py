"""Sequence parallelism: the TP group also splits the sequence where tensor parallelism replicates.

Korthikanti et al. 2022 (arXiv 2205.05198, §4.2.2): outside the tensor-parallel GEMMs a Megatron
block -- LayerNorms, dropouts, the residual stream -- holds the whole b×s×h activation on every
TP rank. Sequence parallelism splits those regions along the sequence instead, so each rank keeps
s/t of them, and replaces Megatron's conjugate operators (``tp_mappings``):

* f (identity / all-reduce) becomes **all-gather** forward, reduce-scatter backward, before a
  column-parallel GEMM: the GEMM needs the whole sequence of its input;
* g (all-reduce / identity) becomes **reduce-scatter** forward, all-gather backward, after a
  row-parallel GEMM: each rank keeps the reduced sum of its own tokens only.

An all-reduce is a reduce-scatter followed by an all-gather, so a block moves the same bytes
(ZeRO §7 counting: 2Ψ = Ψ + Ψ). Tensors here are sequence-first, ``[s, b, h]`` as in Megatron,
so a rank's piece is a contiguous slice and neither collective needs a copy.

The column-parallel GEMM keeps only this rank's s/t piece of its input for backward and
all-gathers it again there (``_GatherLinear``; Megatron's ``LinearWithGradAccumulationAnd-
AsyncCommunication``), which is what gives Korthikanti's 34/t bytes per layer (Table 2) instead
of keeping the gathered s×b×h; that extra all-gather overlaps the input-gradient GEMM, and the
reduce-scatter of that gradient overlaps the weight-gradient GEMM. Inside a full recompute
(``keeping_gathered_inputs``, entered by activation checkpointing's backward) the block's
forward has just gathered that input and its graph lives only until the chunk's backward, so
the gathered tensor is kept instead: the recompute's all-gather serves the weight gradient, and
a checkpointed SP block moves exactly the bytes of its all-reduces without SP, for 2(1 - 1/t)
s·b·h values more in each block of the chunk being recomputed.

Parameters used inside a sequence-parallel region (LayerNorms, the row-parallel biases, the
position table) are replicated but each rank sees only its tokens, so their gradients are
partial sums: ``tp_summed(p)`` passes a parameter through f, whose backward all-reduces its
gradient over TP before autograd accumulates it (Megatron does the same sum after backward).
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch import nn

from zerotron.parallel import collectives as C
from zerotron.parallel.grid import Group
from zerotron.parallel.tp_mappings import copy_to_tp_region


class _Recompute(threading.local):  # per thread: CUDA's autograd runs backward (and a recompute) on its own
    keep = False


_recompute = _Recompute()


@contextlib.contextmanager
def keeping_gathered_inputs(keep: bool = True):
    """While a checkpointed chunk is re-run in backward, column-parallel GEMMs keep their gathered
    input for the weight gradient rather than all-gathering it once more (module docstring);
    ``keep=False``: they gather it again, as Megatron does."""
    before, _recompute.keep = _recompute.keep, keep
    try:
        yield
    finally:
        _recompute.keep = before


def check_sequence_length(seq: int, tp: int) -> None:
    """Sequence parallelism splits the sequence evenly over the TP ranks."""
    if seq % tp:
        raise ValueError(f"sequence length {seq} is not divisible by parallel.tp={tp}, which "
                         f"parallel.sequence_parallel=true splits it over; use a model.seq_length (and "
                         f"batches) divisible by {tp}, or turn parallel.sequence_parallel off")


def _piece(n: int, group: Group) -> int:
    check_sequence_length(n, group.size)
    return n // group.size


def _gather_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[s/t, ...] from every rank → [s, ...] in rank order: one all-gather into a fresh tensor."""
    out = x.new_empty((group.size * x.shape[0], *x.shape[1:]))
    return C.all_gather(out, x.contiguous().detach(), group)  # detached: the work must not pin the graph


def _reduce_scatter_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[s, ...] partial sums → this rank's [s/t, ...] of the reduced sum."""
    out = x.new_empty((_piece(x.shape[0], group), *x.shape[1:]))
    return C.reduce_scatter(out, x.contiguous().detach(), group)


class _GatherFromSequenceRegion(torch.autograd.Function):
    """All-gather along the sequence forward; reduce-scatter of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """Reduce-scatter along the sequence forward (replaces g); all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


class _GatherLinear(torch.autograd.Function):
    """y = all_gather_seq(x) · Wᵀ + b, keeping only x (this rank's s/t) for backward.

    Backward all-gathers x again (asynchronously, while the input gradient is computed) and
    reduce-scatters the input gradient (while the weight gradient is computed). Within a
    recompute (``keep``) the gathered input is kept instead and nothing is gathered again.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, keep):
        ctx.group, ctx.has_bias, ctx.piece, ctx.kept_total = group, bias is not None, x.shape, keep
        total = _gather_seq(x, group)
        ctx.save_for_backward(total if keep else x, weight)
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        group = ctx.group
        if ctx.kept_total:
            total, gathering = x, None
        else:
            total = x.new_empty((group.size * x.shape[0], *x.shape[1:]))
            gathering = C.all_gather(total, x.contiguous().detach(), group, async_op=True)
        grad_input = grad.matmul(weight)
        if gathering is not None:
            gathering.wait()
        grad_x = x.new_empty(ctx.piece)
        scattering = C.reduce_scatter(grad_x, grad_input, group, async_op=True)
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_weight = g2.t().matmul(total.view(-1, total.shape[-1]))
        grad_bias = g2.sum(0) if ctx.has_bias else None
        scattering.wait()
        return grad_x, grad_weight, grad_bias, None, None


def gather_from_sequence_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[s/t, ...] → [s, ...] (all-gather); backward reduce-scatters. Identity on one rank."""
    return x if group.size == 1 else _GatherFromSequenceRegion.apply(x, group)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[s, ...] partial sums → this rank's [s/t, ...] of the sum; backward all-gathers."""
    return x if group.size == 1 else _ReduceScatterToSequenceRegion.apply(x, group)


def gather_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Group) -> torch.Tensor:
    """The column-parallel GEMM of a sequence-parallel input [s/t, b, in] → [s, b, out/t]."""
    if group.size == 1:
        return F.linear(x, weight, bias)
    return _GatherLinear.apply(x, weight, bias, group, _recompute.keep)


def tp_summed(p: torch.Tensor, group: Group) -> torch.Tensor:
    """``p`` unchanged; its gradient all-reduced over TP (a replicated parameter that each rank
    applies to its own tokens only)."""
    return copy_to_tp_region(p, group)


def sequence_parallel_norm(norm: nn.Module, x: torch.Tensor, group: Group) -> torch.Tensor:
    """``norm(x)`` on this rank's tokens, its affine parameters' gradients summed over TP.

    The module's own ``forward`` runs (its fused kernel, where it has one) with the parameters
    passed through f (``torch.func.functional_call``), so names and state are unchanged.
    """
    if group.size == 1:
        return norm(x)
    params = {name: tp_summed(p, group) for name, p in norm.named_parameters(recurse=False)}
    return torch.func.functional_call(norm, params, (x,))
