"""Small models for the ZeRO tests: a tied-embedding transformer-ish stack and a hand-made TP variant.

``TinyLM`` has what exercises every path of the optimizer: an embedding tied to the output layer
(one parameter used at both ends), a position table owned by the root module, a ``ModuleList``
of blocks with LayerNorm (ndim < 2: no weight decay) and biases, and a mean cross-entropy loss.
``TPTinyLM`` splits each block's MLP Megatron-style over ``grid.tp_group`` (column-parallel fc1,
row-parallel fc2, the f/g operators written with zerotron.parallel.collectives) and is built by
slicing a ``TinyLM``, so the single-process reference is the unsplit model.

Both give every parameter a ``ShardInfo`` (``zerotron.parallel.shard_info``), which the ZeRO
optimizer's gradient norm and checkpoints require: ``TinyLM`` is all TP-replicated, ``TPTinyLM``
marks its MLP slices as split.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zerotron.parallel import collectives as C
from zerotron.parallel.shard_info import ShardInfo, mark_replicated, set_shard_info


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16, layers: int = 2, seq: int = 8, tie: bool = True, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        mark_replicated(self)

    def forward(self, x, labels):
        h = self.embed(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.ln_f(h))
        logits = logits.flatten(0, 1)
        return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), labels.flatten())


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the input gradient over TP backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return C.all_reduce(g.contiguous(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return C.all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class TPBlock(nn.Module):
    def __init__(self, full: Block, grid):
        super().__init__()
        tp, r = grid.tp_size, grid.tp_rank
        self.group = grid.tp_group
        self.ln = full.ln  # replicated
        n = full.fc1.out_features // tp
        self.w1 = nn.Parameter(full.fc1.weight.detach()[r * n:(r + 1) * n].clone())
        self.b1 = nn.Parameter(full.fc1.bias.detach()[r * n:(r + 1) * n].clone())
        self.w2 = nn.Parameter(full.fc2.weight.detach()[:, r * n:(r + 1) * n].clone())
        self.b2 = nn.Parameter(full.fc2.bias.detach().clone())  # replicated, added after g
        for p, dim in ((self.w1, 0), (self.b1, 0), (self.w2, 1)):
            set_shard_info(p, ShardInfo.from_local(p.shape, dim, tp))

    def forward(self, x):
        h = _CopyToTP.apply(self.ln(x), self.group)
        h = F.gelu(F.linear(h, self.w1, self.b1))
        return x + _ReduceFromTP.apply(F.linear(h, self.w2), self.group) + self.b2


class TPTinyLM(nn.Module):
    def __init__(self, full: TinyLM, grid):
        super().__init__()
        import copy
        full = copy.deepcopy(full)
        self.embed, self.pos, self.ln_f, self.head = full.embed, full.pos, full.ln_f, full.head
        self.blocks = nn.ModuleList(TPBlock(b, grid) for b in full.blocks)
        mark_replicated(self)  # deepcopy drops ShardInfo: everything but the MLP slices is replicated

    forward = TinyLM.forward


def tp_slice(name: str, full_value: torch.Tensor, grid) -> torch.Tensor:
    """The TP-local slice of a ``TinyLM`` parameter under ``TPTinyLM``'s naming."""
    tp, r = grid.tp_size, grid.tp_rank
    if ".w1" in name or ".b1" in name:
        n = full_value.shape[0] // tp
        return full_value[r * n:(r + 1) * n]
    if ".w2" in name:
        n = full_value.shape[1] // tp
        return full_value[:, r * n:(r + 1) * n]
    return full_value


TP_NAMES = {"w1": "fc1.weight", "b1": "fc1.bias", "w2": "fc2.weight", "b2": "fc2.bias"}


def reference_name(tp_name: str) -> str:
    parts = tp_name.split(".")
    return ".".join(TP_NAMES.get(p, p) for p in parts)
