"""Shared pieces of the ZeRO tests: data, the single-process torch.optim.AdamW reference, a ZeRO loop."""

from __future__ import annotations

import copy

import torch

VOCAB, SEQ = 32, 8
from zerotron.testing.zero_runs import HYPER  # the same hyper-parameters as the ZeRO++ runs


def batches(steps: int, micro: int, dp: int, per_rank: int = 2, seed: int = 7):
    """``steps`` global batches, each a list of ``micro`` micro-batches of ``dp * per_rank`` sequences."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        mbs = []
        for _ in range(micro):
            x = torch.randint(0, VOCAB, (dp * per_rank, SEQ), generator=g)
            y = torch.randint(0, VOCAB, (dp * per_rank, SEQ), generator=g)
            mbs.append((x, y))
        out.append(mbs)
    return out


def reference_train(model, data, clip: float | None = 1.0):
    """Single process, full batch: mean loss over every sequence, clip_grad_norm_, torch AdamW."""
    model = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": HYPER["weight_decay"]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"], foreach=False)
    losses = []
    for mbs in data:
        x = torch.cat([m[0] for m in mbs])
        y = torch.cat([m[1] for m in mbs])
        loss = model(x, y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return model, losses


def zero_train(model, opt, data, dp_rank: int, per_rank: int = 2, inject=None):
    """The trainer's loop: this rank's slice of every micro-batch, opt.backward per micro-batch, opt.step."""
    infos, losses = [], []
    for step, mbs in enumerate(data):
        total = 0.0
        for i, (x, y) in enumerate(mbs):
            sl = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
            loss = model(x[sl], y[sl])
            if inject is not None:
                loss = inject(step, i, loss)
            opt.backward(loss / len(mbs), last_microbatch=(i == len(mbs) - 1))
            total += float(loss.detach()) / len(mbs)
        infos.append(opt.step())
        losses.append(total)
    return infos, losses
