"""Selective activation recompute: re-run only the attention core in backward (Korthikanti et al.
2022, arXiv 2205.05198 §5; Megatron's ``--recompute-granularity selective``).

Per layer, the attention core -- QKᵀ, softmax, dropout, probabilities · V -- stores
5·a·s²·b bytes (softmax output, dropout mask, dropout output; Table 2) for a small share of the
layer's FLOPs, so it is the part worth recomputing: ``_RecomputedCore`` keeps only its inputs
Q, K, V (views of the QKV GEMM's output, which the layer stores anyway) and in backward runs the
core again with a graph and back-propagates through it. What a layer keeps then falls from
s·b·h·(34 + 5·a·s/h) to 34·s·b·h (/t with TP and sequence parallelism).

Exact with dropout: every random stream is captured before the core runs
(``parallel.rng.capture_rng``: the TP-shared default generators and ``TPRNG``'s per-rank
streams) and restored around the recompute, so the recomputed dropout mask is the same bits as
in forward, and the streams then continue as if nothing had been replayed. Gradients are bit-identical to no recompute.

It composes with full recompute (``checkpoint_activations``): a checkpointed chunk's own
recompute then also skips storing its attention probabilities, which bounds the working memory
of a chunk of ``checkpoint_every`` > 1 layers.
"""

from __future__ import annotations

import torch

from zerotron.parallel.rng import capture_rng, restore_rng


class _RecomputedCore(torch.autograd.Function):
    """core(q, k, v) without a graph; backward replays the streams, recomputes and back-propagates."""

    @staticmethod
    def forward(ctx, rng, core, q, k, v):
        ctx.rng, ctx.core = rng, core
        ctx.rng_states = capture_rng(rng)
        ctx.save_for_backward(q, k, v)
        return core(q, k, v)  # grad mode is off inside forward: nothing of the core is kept

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in saved]
        now = capture_rng(ctx.rng)
        restore_rng(ctx.rng, ctx.rng_states)  # the same dropout mask as in forward
        try:
            with torch.enable_grad():
                y = ctx.core(*inputs)
        finally:
            restore_rng(ctx.rng, now)  # the streams continue as if nothing had been replayed
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(y, wanted, grad) if wanted else ())
        ctx.core = None
        return (None, None) + tuple(next(grads) if t.requires_grad else None for t in inputs)


class SelectiveRecompute:
    """The ``core_runner`` of a ``ParallelAttention``: called as ``runner(core, q, k, v)``."""

    def __init__(self, rng) -> None:
        self.rng = rng

    def __call__(self, core, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or not any(t.requires_grad for t in (q, k, v)):
            return core(q, k, v)  # nothing will run backward: nothing to save or recompute
        return _RecomputedCore.apply(self.rng, core, q, k, v)


def apply_selective_recompute(model) -> int:
    """Recompute the attention core of every block of ``model`` (a ``GPT`` or a stage of one) in
    backward; returns the number of attention modules changed."""
    rng = getattr(model, "rng", None)
    count = 0
    for block in getattr(model, "blocks", ()):
        attn = getattr(block, "attn", None)
        if attn is None or not hasattr(attn, "core_runner"):
            raise TypeError(f"selective recompute: {type(block).__name__} has no attention `core_runner` hook; "
                            f"pass a zerotron.model.GPT (or a stage built from one)")
        if attn.core_runner is not None:
            raise RuntimeError("selective recompute: the attention already has a core_runner; apply it once per model")
        attn.core_runner = SelectiveRecompute(rng)
        count += 1
    return count
