"""Sequence parallelism (Korthikanti et al. 2022) on TP 2 × DP 2 gloo ranks, in one launch.

* training: 20 fp32 steps through ``parallelize_gpt`` with ``parallel.sequence_parallel`` give the
  single-process losses (rtol 1e-5);
* gradients: float64, every parameter (TP shards gathered, DP averaged) against one process on
  the whole batch, to ``FP64_TP_PP``;
* dropout: attention-probability masks are the *same* bits with and without SP (both draw the
  per-rank TP stream, advanced identically), so SP equals TP 2 without SP in float64; residual
  and embedding masks are *per rank* with SP (each rank holds different tokens), so they are
  checked for what they must be: the SP run equals a TP 2 run without SP that is handed the SP
  run's masks, gathered (float64), the ranks' masks differ, and the drop rate is p within 5σ;
* communication per block: the SP all-gathers + reduce-scatters move exactly the bytes of the
  all-reduces without SP, forward; backward adds exactly the re-gather of the two
  column-parallel inputs (2·b·s·h; kept as s/t pieces for Table 2's 34/t) and the 6 h-element
  all-reduces of the LayerNorm and row-parallel bias gradients; under full recompute the
  recompute's gathers are kept for the weight gradients, and forward + recompute + backward
  moves exactly the all-reduce bytes of the same block without SP (``sequence_parallel_gather:
  regather``, Megatron's, adds the re-gather back);
* TP 2 × PP 2 with SP: the stages exchange sequence pieces; float64 gradients of every stage;
* no b×s×h copy in a TP block's forward+backward (issue 22): ``Tensor.clone`` / ``copy_`` /
  copying ``contiguous()`` wrapped and counted; the old cloning f/g make the count 4.
"""

import torch

from tests.harness import spawn
from tests.parity import FP64_TP_PP, assert_bitwise, assert_fp64
from zerotron.model import GPT, GPTConfig
from zerotron.parallel import Grid, ParallelDims
from zerotron.parallel.shard_info import shard_info

SHAPE = dict(num_layers=2, hidden_size=32, num_heads=4, vocab_size=90, seq_length=16, make_vocab_size_divisible_by=8)


def _batch(seed, n, s=16, vocab=90):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, s + 1), generator=g)


def _full_grads(model):
    """Every gradient, TP shards gathered (test code: torch.distributed directly)."""
    import torch.distributed as dist

    out = {}
    for name, p in model.named_parameters():
        g, dim = p.grad, shard_info(p, name).tp_split_dim
        if dim is not None and model.grid.tp_size > 1:
            parts = [torch.empty_like(g) for _ in range(model.grid.tp_size)]
            dist.all_gather(parts, g.contiguous(), group=model.grid.tp_group.pg)
            g = torch.cat(parts, dim)
        out[name] = g[:90] if model.global_name(name) == "embedding.word.weight" else g  # padding rows
    return out


def _train(grid, sp, steps, batches):
    from zerotron.config.run_config import RunConfig
    from zerotron.training.parallelize import parallelize_gpt

    run = RunConfig()
    run.parallel = ParallelDims(tp=grid.tp_size, sequence_parallel=sp)
    per_rank = batches[0].shape[0] // grid.dp_size
    run.training.micro_batch_size, run.training.global_batch_size = per_rank, batches[0].shape[0]
    run.training.precision, run.optimizer.lr = "fp32", 3e-3
    plan = parallelize_gpt(run.validate(grid.world_size), GPTConfig(**SHAPE), grid)
    sl = slice(grid.dp_rank * per_rank, (grid.dp_rank + 1) * per_rank)
    losses = []
    for batch in batches[:steps]:
        x = batch[sl]
        loss = plan.model(x[:, :-1], labels=x[:, 1:])
        plan.optimizer.backward(loss)
        plan.optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def check_training(grid, ref_grid):
    import torch.distributed as dist

    batches = [_batch(100 + i, 4) for i in range(20)]
    mine = _train(grid, True, 20, batches)
    dist.all_reduce(mine, group=grid.dp_group.pg)
    ref = _train(ref_grid, False, 20, batches)
    torch.testing.assert_close(mine / grid.dp_size, ref, rtol=1e-5, atol=0)


def check_fp64_grads(grid, ref_grid):
    import torch.distributed as dist

    batch = _batch(7, 4)
    ref = GPT(GPTConfig(**SHAPE), ref_grid, dtype=torch.float64, seed=5)
    ref(batch[:, :-1], batch[:, 1:]).backward()
    want = _full_grads(ref)
    sp = GPT(GPTConfig(**SHAPE), grid, dtype=torch.float64, seed=5, sequence_parallel=True)
    x = batch[2 * grid.dp_rank: 2 * grid.dp_rank + 2]
    sp(x[:, :-1], x[:, 1:]).backward()
    for name, g in _full_grads(sp).items():
        dist.all_reduce(g, group=grid.dp_group.pg)
        assert_fp64(g / grid.dp_size, want[name], FP64_TP_PP, f"SP TP2xDP2 gradient {name}")


def check_pipeline(ref_grid):
    """TP 2 × PP 2 with SP: stages exchange [s/t, b, h] pieces; float64 gradients of every stage."""
    from zerotron.model.stages import build_stage, pipeline_step

    grid = Grid(ParallelDims(tp=2, pp=2, sequence_parallel=True))
    data = [_batch(20 + i, 2) for i in range(2)]
    ref = GPT(GPTConfig(**SHAPE), ref_grid, dtype=torch.float64, seed=5)
    (sum(ref(x[:, :-1], x[:, 1:]) for x in data) / len(data)).backward()
    want = {ref.global_name(n): g for n, g in _full_grads(ref).items()}
    stage = build_stage(GPTConfig(**SHAPE), grid, dtype=torch.float64, seed=5, sequence_parallel=True)
    assert stage.hidden_shape(2) == (SHAPE["seq_length"] // 2, 2, SHAPE["hidden_size"])
    pipeline_step(stage, [(x[:, :-1], x[:, 1:]) for x in data])
    for name, g in _full_grads(stage).items():
        assert_fp64(g, want[stage.global_name(name)], FP64_TP_PP, f"SP pipeline stage {grid.pp_rank}: {name}")


def _loss_and_grads(model, x):
    loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def check_dropout(grid):
    import torch.distributed as dist

    x = _batch(9, 2)
    # attention dropout only: the same masks with and without SP
    cfg = GPTConfig(**SHAPE, attention_dropout=0.1)
    (l_sp, g_sp), (l_tp, g_tp) = (_loss_and_grads(GPT(cfg, grid, dtype=torch.float64, seed=5, sequence_parallel=sp), x)
                                  for sp in (True, False))
    assert_fp64(l_sp, l_tp, FP64_TP_PP, "attention dropout: SP vs TP loss")
    for name in g_sp:
        assert_fp64(g_sp[name], g_tp[name], FP64_TP_PP, f"attention dropout: SP vs TP gradient {name}")

    # residual + embedding dropout: per-rank masks with SP, replayed into the model without SP
    p = 0.1
    cfg = GPTConfig(**SHAPE, dropout=p, attention_dropout=0.1)
    sp = GPT(cfg, grid, dtype=torch.float64, seed=5, sequence_parallel=True)
    drops = [sp.embedding.dropout] + [b.dropout for b in sp.blocks]
    masks = []
    hooks = [d.register_forward_hook(lambda m, i, o: masks.append(o != 0)) for d in drops]
    l_sp, g_sp = _loss_and_grads(sp, x)
    for h in hooks:
        h.remove()
    assert len(masks) == 1 + 2 * cfg.num_layers
    full = []
    for m in masks:  # [s/t, b, h] per rank → [b, s, h]
        parts = [torch.empty_like(m) for _ in range(grid.tp_size)]
        dist.all_gather(parts, m, group=grid.tp_group.pg)
        assert not torch.equal(parts[0], parts[1]), "SP dropout: the TP ranks drew the same mask"
        full.append(torch.cat(parts).transpose(0, 1))
    dropped = torch.cat([f.flatten() for f in full]).logical_not().double()
    n = dropped.numel()
    assert abs(dropped.mean().item() - p) < 5 * (p * (1 - p) / n) ** 0.5, f"drop rate {dropped.mean():.4f} != {p}"
    tp = GPT(cfg, grid, dtype=torch.float64, seed=5)
    replay = iter(full)
    hooks = [d.register_forward_hook(lambda m, i, o: i[0] * next(replay) / (1 - p))
             for d in [tp.embedding.dropout] + [b.dropout for b in tp.blocks]]
    l_tp, g_tp = _loss_and_grads(tp, x)
    assert_fp64(l_sp, l_tp, FP64_TP_PP, "SP dropout = TP with the SP masks: loss")
    for name in g_sp:
        assert_fp64(g_sp[name], g_tp[name], FP64_TP_PP, f"SP dropout = TP with the SP masks: {name}")
    sp.rng.seed(5, grid)
    again = sp(x[:, :-1], x[:, 1:]).detach()
    sp.rng.seed(5, grid)
    assert_bitwise(sp(x[:, :-1], x[:, 1:]).detach(), again, "SP dropout replays from the seed")


def _block_traffic(grid, sp, b=2, recompute=False, gather="keep"):
    from zerotron.activation import ActivationCheckpointConfig, apply_activation_checkpointing

    model = GPT(GPTConfig(**SHAPE), grid, seed=5, sequence_parallel=sp)
    x = torch.randn(model.hidden_shape(b), requires_grad=True)
    run = model.blocks[0]
    if recompute:
        ac = ActivationCheckpointConfig(checkpoint_activations=True, sequence_parallel_gather=gather)
        handle = apply_activation_checkpointing(model, grid, ac)
        run = lambda x: handle([model.blocks[0]], x)  # noqa: E731
    mark = grid.stats.snapshot()
    y = run(x)
    fwd = grid.stats.since(mark)
    mark = grid.stats.snapshot()
    y.sum().backward()
    return fwd, grid.stats.since(mark)


def check_comm(grid):
    b, s, h = 2, SHAPE["seq_length"], SHAPE["hidden_size"]
    bsh_bytes = b * s * h * 4
    (f_tp, b_tp), (f_sp, b_sp) = _block_traffic(grid, False), _block_traffic(grid, True)

    def ag_rs(c):
        return c.get("all_gather", "tp").bytes + c.get("reduce_scatter", "tp").bytes

    assert f_tp.get("all_reduce", "tp").bytes == 2 * 2 * bsh_bytes  # two all-reduces, 2Ψ each
    assert ag_rs(f_sp) == f_tp.get("all_reduce", "tp").bytes and f_sp.get("all_reduce", "tp").calls == 0
    assert ag_rs(b_sp) == b_tp.get("all_reduce", "tp").bytes + 2 * bsh_bytes, (b_sp.snapshot(), b_tp.snapshot())
    ln_bias = b_sp.get("all_reduce", "tp")
    assert ln_bias.calls == 6 and ln_bias.elements == 2 * 6 * h, ln_bias
    (f_tp, b_tp), (f_sp, b_sp) = _block_traffic(grid, False, recompute=True), _block_traffic(grid, True, recompute=True)
    assert ag_rs(f_sp) == f_tp.get("all_reduce", "tp").bytes == 2 * 2 * bsh_bytes
    # backward = recompute + backward: the recompute's gathers serve the weight gradients
    assert b_tp.get("all_reduce", "tp").bytes == 2 * 2 * 2 * bsh_bytes
    assert ag_rs(b_sp) == b_tp.get("all_reduce", "tp").bytes, (b_sp.snapshot(), b_tp.snapshot())
    _, b_regather = _block_traffic(grid, True, recompute=True, gather="regather")  # Megatron's
    assert ag_rs(b_regather) == ag_rs(b_sp) + 2 * bsh_bytes, b_regather.snapshot()


class _CopyCounter:
    """Counts ``Tensor.clone`` / ``copy_`` / copying ``contiguous()`` of at least ``numel`` elements,
    forward and backward (the methods are wrapped on the class, so autograd's thread sees them too)."""

    NAMES = ("clone", "copy_", "contiguous")

    def __init__(self, numel):
        self.numel, self.calls, self._saved = numel, [], {}

    def _wrap(self, name, method):
        def counted(t, *args, **kwargs):
            if t.numel() >= self.numel and (name != "contiguous" or not t.is_contiguous()):
                self.calls.append(name)
            return method(t, *args, **kwargs)
        return counted

    def __enter__(self):
        for name in self.NAMES:
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)


def _block_copies(grid, sp, b=2):
    model = GPT(GPTConfig(**SHAPE), grid, seed=5, sequence_parallel=sp)
    x = torch.randn(model.hidden_shape(b), requires_grad=True)
    counter = _CopyCounter(b * SHAPE["seq_length"] * SHAPE["hidden_size"] // grid.tp_size)
    with counter:
        fwd = model.blocks[0](x)
        n_fwd = len(counter.calls)
        fwd.backward(torch.randn_like(fwd))  # a contiguous gradient, as from the next block
    return n_fwd, len(counter.calls) - n_fwd


def check_no_copies(grid):
    import zerotron.parallel.tp_mappings as M
    from zerotron.parallel import collectives as C

    assert _block_copies(grid, False) == (0, 0), "a TP block copies b×s×h tensors in f/g"
    assert _block_copies(grid, True) == (0, 0), "a sequence-parallel block copies b×s×h tensors"
    saved = M._all_reduce_, M._reducible_in_place
    M._all_reduce_ = lambda x, group: C.all_reduce(x.contiguous().clone(), group)  # before issue 22
    M._reducible_in_place = lambda x: False
    try:
        n_fwd, n_bwd = _block_copies(grid, False)
    finally:
        M._all_reduce_, M._reducible_in_place = saved
    assert n_fwd >= 2 and n_bwd == 2, (n_fwd, n_bwd)  # the counter sees the old clones, both ways


def check_all():
    grid = Grid(ParallelDims(tp=2, sequence_parallel=True))
    ref_grid = Grid(ParallelDims(), rank=0, world_size=1)
    check_no_copies(grid)
    check_comm(grid)
    check_dropout(grid)
    check_fp64_grads(grid, ref_grid)
    check_training(grid, ref_grid)
    check_pipeline(ref_grid)
    return True


def test_sequence_parallel_tp2_dp2():
    assert all(spawn(check_all, 4, timeout=150))


def test_sequence_parallel_errors():
    import pytest

    with pytest.raises(ValueError, match="parallel.sequence_parallel=true with parallel.tp=1"):
        ParallelDims(tp=1, sequence_parallel=True).resolve(1)
    with pytest.raises(ValueError, match="parallel.sequence_parallel"):
        ParallelDims(tp=2, sequence_parallel="yes").resolve(2)
    from zerotron.parallel.sequence_parallel import check_sequence_length

    with pytest.raises(ValueError, match="sequence length 15 is not divisible by parallel.tp=2"):
        check_sequence_length(15, 2)
