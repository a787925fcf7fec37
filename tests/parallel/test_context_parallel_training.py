"""20 fp32 training steps under context parallelism against the single process, 4 gloo ranks.

Layouts: TP 2 x CP 2 (ZeRO-1), CP 2 x DP 2 (ZeRO-2), CP 4 at seq 512 (ZeRO-3). Reference
(computed once, in the test's own process): the same GPT (same seed, so the same weights)
trained on the whole global batch by ``torch.optim.AdamW`` with ``clip_grad_norm_``
(``tests/zero/common.reference_train``'s loop, on a model that cannot be deep-copied: it holds
its grid), once in float64 (the truth) and once in fp32 (torch's own fp32 error). Each step's loss of the
CP run -- reported as the trainer does, averaged over DP x CP -- must lie within
``tests/parity.assert_fp32``'s bound: twice torch's own fp32 error plus 1e-7.
"""

from __future__ import annotations

import torch

from tests.harness import spawn
from tests.parity import assert_fp32
from tests.zero.common import HYPER
from zerotron.model import GPT, GPTConfig
from zerotron.parallel import Grid, ParallelDims
from zerotron.parallel import collectives as C

STEPS, PER_RANK = 20, 2
LAYOUTS = [dict(tp=2, cp=2, stage=1, seq=32), dict(cp=2, stage=2, seq=32),
           dict(cp=4, stage=3, seq=512)]


def data(vocab, seq, dp):
    """STEPS global batches of a learnable Markov chain (the loss must fall)."""
    from zerotron.testing.zero_runs import markov_batches

    chain = markov_batches(vocab, dp * PER_RANK, seq + 1, seed=5)
    return [[(b[:, :-1], b[:, 1:])] for b in (next(chain) for _ in range(STEPS))]


def gpt_config(seq):
    return GPTConfig(num_layers=2, hidden_size=16, num_heads=2, vocab_size=64, seq_length=seq,
                     dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8)


def reference(model, batches):
    """Single process, whole batch: mean loss, clip_grad_norm_ 1.0, torch AdamW; the losses."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": HYPER["weight_decay"]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"],
                            foreach=False)
    losses = []
    for (x, y), in batches:
        loss = model(x, labels=y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def train_layout(tp=1, cp=1, stage=0, seq=32):
    from zerotron.zero import ZeroConfig, ZeroOptimizer

    cfg = gpt_config(seq)
    grid = Grid(ParallelDims(tp=tp, cp=cp))
    batches = data(cfg.vocab_size, seq, grid.dp_size)
    model = GPT(cfg, grid, seed=3)
    zcfg = ZeroConfig(stage=stage, reduce_bucket_size=500, allgather_bucket_size=500)
    opt = ZeroOptimizer(model, grid, zcfg, clip_grad=1.0, precision="fp32", **HYPER)
    losses = []
    for (x, y), in batches:
        # this DP rank's samples: every CP rank of it the same ones
        mine = slice(grid.dp_rank * PER_RANK, (grid.dp_rank + 1) * PER_RANK)
        loss = model(x[mine], labels=y[mine])
        opt.backward(loss)
        opt.step()
        losses.append(loss.detach().reshape(1))
    mean = C.all_reduce(torch.cat(losses), grid.dp_cp_group) / grid.dp_cp_group.size
    grid.close()
    return mean


def all_layouts():
    torch.set_num_threads(1)
    return [train_layout(**lay) for lay in LAYOUTS]


def test_fp32_losses_equal_the_single_process_within_fp32_noise():
    per_rank = spawn(all_layouts, 4, timeout=400)
    ref_grid = Grid(ParallelDims(), rank=0, world_size=1)  # the references: this process alone
    for lay, got in zip(LAYOUTS, per_rank[0]):
        cfg = gpt_config(lay["seq"])
        batches = data(cfg.vocab_size, lay["seq"], 4 // (lay.get("tp", 1) * lay["cp"]))
        truth = torch.tensor(reference(GPT(cfg, ref_grid, seed=3, dtype=torch.float64), batches),
                             dtype=torch.float64)
        torch_fp32 = torch.tensor(reference(GPT(cfg, ref_grid, seed=3), batches),
                                  dtype=torch.float32)
        assert truth[-1] < truth[0] - 0.2, truth  # it learns: a layout that did not would show
        assert_fp32(got, truth, torch_fp32, f"{lay} losses over {STEPS} steps")
    ref_grid.close()
