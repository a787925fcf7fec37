"""Cross-entropy over logits split along the vocabulary, without gathering them.

Megatron-LM §3 fuses the output GEMM with the loss so that only b×s values cross the TP group
instead of the b×s×V logits ([MLM] ``cross_entropy.py``). Forward makes three all-reduces of
b×s elements -- the MAX of the per-rank logit maxima (for a stable softmax), the SUM of the
target logit (only the owning rank contributes), and the SUM of Σexp -- and backward is local:
∂loss/∂logit = softmax − onehot(target), each rank on its own slice.

Vocabulary padding (Megatron pads 50,257 to 51,200 so the table splits evenly) adds columns
that are not tokens. They are set to the lowest finite value before the max, so they can never
win the softmax, get probability exactly 0 and therefore gradient exactly 0.

Targets equal to ``ignore_index`` contribute loss 0 and gradient 0 (as in
``torch.nn.functional.cross_entropy``); the loss is returned per token, in fp32.
"""

from __future__ import annotations

import torch

from zerotron.parallel import collectives as C
from zerotron.parallel.grid import Group


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, vocab_size, ignore_index):
        # the softmax is computed in fp32 at least (fp64 logits stay fp64: the parity tests' tier)
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))
        per_rank = x.shape[-1]
        n_padded = vocab_start + per_rank - vocab_size
        if n_padded > 0:
            x = x.clone() if x is logits else x
            x[..., max(per_rank - n_padded, 0):].fill_(torch.finfo(x.dtype).min)  # a scalar argument: no host tensor
        row_max = x.amax(dim=-1)
        C.all_reduce(row_max, group, op="max")
        x = x - row_max.unsqueeze(-1)  # new tensor; the caller's logits are untouched

        outside = (target < vocab_start) | (target >= vocab_start + per_rank)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        C.all_reduce(target_logit, group)

        exp = x.exp_()
        sum_exp = exp.sum(dim=-1)
        C.all_reduce(sum_exp, group)
        loss = sum_exp.log() - target_logit

        ignored = target == ignore_index
        loss = loss.masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside | ignored, ignored)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, not_mine, ignored = ctx.saved_tensors
        grad = softmax  # saved buffer is ours alone; reuse it
        hit = (~not_mine).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        scale = grad_loss.to(grad.dtype).masked_fill(ignored, 0.0).unsqueeze(-1)
        grad.mul_(scale)
        return grad.to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Group,
                                 vocab_start: int, vocab_size: int | None = None,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss [*] (fp32) of ``logits`` [*, V_local] holding vocab ids [vocab_start, +V_local).

    ``vocab_size`` is the real vocabulary; global columns at or beyond it are padding and are
    masked out (None: no padding). With one TP rank this is exactly softmax cross-entropy.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and target "
                         f"{tuple(target.shape)} disagree; logits must be target.shape + (V_local,)")
    if vocab_size is None:
        vocab_size = vocab_start + logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_start, vocab_size, ignore_index)
