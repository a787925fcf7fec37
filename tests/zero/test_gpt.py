"""zerotron.model.GPT under ZeRO, TP 2 x DP 2: stages 0, 1, 2, 3 (default stage-3 units: the root
with the tied embedding/head, one unit per block) against torch AdamW, 4 steps of 2 micro-batches
on the same batch (the loss must fall).

Reference (every rank computes it): the same GPT built on a tp = 1 view (``Grid(ParallelDims())``:
parameters are initialised by global name, so the same full weights), both micro-batches of both
DP ranks as one batch, ``clip_grad_norm_(1.0)``, ``torch.optim.AdamW`` with eps 1e-8.

* float64: model float64, ``ZeroConfig(precision="fp64")``, the reference in float64; every
  TP-local slice of the final parameters within ``FP64_TP_PP`` (TP splits reorder the matmul and
  all-reduce sums: below 1e-12 in float64, while a missed micro-batch or shard moves it by > 1e-4).
* fp32: one step of every stage in fp32; this rank's reduced gradient partition (after the TP
  all-reduces and ZeRO's DP reduction, before clipping) against the float64 reference's first
  gradient, within twice the fp32 torch reference's own error (``assert_fp32``). Gradients, not
  parameters: the key bias has a true gradient of 0 (softmax is shift-invariant), and Adam with
  eps 1e-8 turns its fp32 noise into lr-sized steps of random sign in torch's run as in ours, so
  the parameters after a step carry no stable fp32 error to bound.
"""

import torch

from tests.harness import spawn
from tests.parity import FP64_TP_PP, assert_fp32, assert_fp64
from tests.zero.common import HYPER
from zerotron.parallel.shard_info import shard_info
from zerotron.zero.optimizer import DTYPES

STEPS, MICRO = 4, 2


def reference(cfg, data, precision):
    """The whole model on one rank, full batch, torch AdamW; (final parameters, first gradients) by name."""
    from zerotron.model.gpt import GPT
    from zerotron.parallel import Grid, ParallelDims

    model = GPT(cfg, Grid(ParallelDims()), seed=11, dtype=DTYPES[precision])
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2]},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            foreach=False, **HYPER)
    grads = None
    for mbs in data:
        batch = torch.cat(mbs)
        model(batch[:, :-1], labels=batch[:, 1:]).backward()
        grads = grads or {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach() for n, p in model.named_parameters()}, grads


def reduced_gradient(opt):
    """This rank's reduced gradient partition, as (name, start, end, values) per parameter piece."""
    out = []
    for c in opt.layout.chunks:
        shard = opt.reducer.grad_shard(c)
        for p, start, end, off in opt.layout.shard_pieces(c):
            out.append((opt.names[p], start, end, shard[off:off + end - start].clone()))
    return out


def train(cfg, grid, data, stage, precision):
    """ZeroOptimizer on this rank's TP slice and DP share; (model, final params, losses, first reduced gradient)."""
    from zerotron.model.gpt import GPT
    from zerotron.zero import ZeroConfig, ZeroOptimizer

    model = GPT(cfg, grid, seed=11, dtype=DTYPES[precision])
    zcfg = ZeroConfig(stage=stage, reduce_bucket_size=2000, allgather_bucket_size=2000,
                      stage3_param_persistence_threshold=64, stage3_prefetch_bucket_size=10_000)
    opt = ZeroOptimizer(model, grid, zcfg, clip_grad=1.0, precision=precision, **HYPER)
    losses, grads = [], None
    for mbs in data:
        total = 0.0
        for i, batch in enumerate(mbs):
            mine = batch[grid.dp_rank * 2:(grid.dp_rank + 1) * 2]
            loss = model(mine[:, :-1], labels=mine[:, 1:])
            opt.backward(loss / len(mbs), last_microbatch=i == len(mbs) - 1)
            total += float(loss.detach()) / len(mbs)
        grads = grads or reduced_gradient(opt)
        opt.step()
        losses.append(total)
    return model, dict(opt.full_params()), losses, grads


def check_gpt_stages_equal_reference():
    from zerotron.model.config import GPTConfig
    from zerotron.parallel import Grid, ParallelDims

    grid = Grid(ParallelDims(tp=2))
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_heads=4, vocab_size=100, seq_length=8,
                    make_vocab_size_divisible_by=64)  # padded to 128 rows for tp 1 and 2 alike
    g = torch.Generator().manual_seed(3)
    data = [[torch.randint(0, 100, (4, 9), generator=g) for _ in range(MICRO)]] * STEPS
    (truth, truth_grads), (_, torch32_grads) = reference(cfg, data, "fp64"), reference(cfg, data[:1], "fp32")

    def local(full, p):
        dim = shard_info(p).tp_split_dim
        return full if dim is None else full.chunk(grid.tp_size, dim=dim)[grid.tp_rank]

    for stage in (0, 1, 2, 3):
        model, final, losses, _ = train(cfg, grid, data, stage, "fp64")
        assert losses[-1] < losses[0], (stage, losses)
        for name, p in model.named_parameters():
            assert_fp64(final[name], local(truth[name], p), FP64_TP_PP, f"fp64 stage {stage}: {name}")
        model, _, _, pieces = train(cfg, grid, data[:1], stage, "fp32")
        params = dict(model.named_parameters())
        for name, start, end, got in pieces:
            want, ref = (local(g[name], params[name]).reshape(-1)[start:end] for g in (truth_grads, torch32_grads))
            assert_fp32(got, want, ref, f"fp32 stage {stage}: gradient of {name}[{start}:{end}]")
    return True


def test_gpt_tp2_dp2_all_stages_equal_reference():
    assert all(spawn(check_gpt_stages_equal_reference, 4, timeout=170))
