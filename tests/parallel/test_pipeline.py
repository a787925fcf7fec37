"""Pipeline parallelism (1F1B and AFAB) against the non-pipelined single-process reference, gloo CPU.

Reference (every rank computes it): the whole GPT built with the same seed on a tp = pp = 1 view
(``GPT(cfg, Grid(ParallelDims()))``, so the same full weights), trained on the full global batch
(every micro-batch of every DP rank concatenated) with ``torch.optim.AdamW`` (eps 1e-8) and
``clip_grad_norm_`` -- no pipeline, no ZeRO. Layouts: PP 2 (2 ranks), PP 4 (4 ranks), and
TP 2 x PP 2 x DP 2 (8 ranks) with ZeRO stages 1 and 2. Two tiers of ``tests/parity.py``:

* float64: model float64, ``ZeroConfig(precision="fp64")`` (or torch AdamW), the reference in
  float64. The loss and every parameter slice after each of 3 steps within ``FP64_TP_PP``: the
  split reorders matmul and reduction sums, and float64 round-off stays below 1e-12 even where
  Adam divides a near-eps gradient, while dropping one micro-batch's gradient moves a parameter
  by ~1e-2.
* fp32 (every run; runs differing only in ZeRO stage 1 / 2 share one): one step of the run in
  fp32 with ZeRO stage 0, so ``.grad`` holds the whole gradient after the TP, tied-embedding and
  DP reductions; every gradient slice against the float64 reference's, within twice torch fp32's
  own error on the same batch (``assert_fp32``). Gradients, not parameters: Adam with eps 1e-8
  turns fp32 noise in near-zero gradients (the key bias has a true gradient of 0: softmax is
  shift-invariant) into lr-sized steps of random sign, in torch's run as in ours, so the
  parameters after a step carry no stable fp32 error to compare against. The fp32 loss is left
  to the float64 tier too: the micro-batch mean and the DP average round it more often than
  torch's one mean, up to one ulp at a loss of ~4 (4.8e-7), beyond the 1e-7 floor.

In every run the first stage's word embedding and the last stage's tied copy are bit-identical
after every step, and the schedule's forward/backward order and p2p count are checked.
"""

import pytest
import torch
import torch.distributed as dist

from tests.harness import spawn
from tests.parity import FP64_TP_PP, assert_fp32, assert_fp64
from tests.zero.common import HYPER
from zerotron.model import GPT, GPTConfig
from zerotron.model.stages import build_stage, pipeline_step, split_layers
from zerotron.parallel import Grid, ParallelDims
from zerotron.parallel.pipeline import microbatches_in_flight
from zerotron.parallel.shard_info import shard_info
from zerotron.zero.optimizer import DTYPES

SEED, STEPS, MICRO = 7, 3, 2  # MICRO: sequences per micro-batch per DP rank


def make_cfg(num_layers):
    return GPTConfig(num_layers=num_layers, hidden_size=16, num_heads=2, vocab_size=60, seq_length=8,
                     make_vocab_size_divisible_by=8)  # padded vocab 64 for tp 1 and 2


def make_data(cfg, m, dp, seed=3):
    """STEPS global batches of m micro-batches, each of dp * MICRO sequences."""
    g = torch.Generator().manual_seed(seed)
    shape = (dp * MICRO, cfg.seq_length)
    return [[(torch.randint(0, cfg.vocab_size, shape, generator=g),
              torch.randint(0, cfg.vocab_size, shape, generator=g)) for _ in range(m)] for _ in range(STEPS)]


def reference(cfg, data, ref_grid, clip, precision):
    """The whole model, full batch, torch AdamW; returns (losses, params after each step, first gradients)."""
    model = GPT(cfg, ref_grid, seed=SEED, dtype=DTYPES[precision])
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2]},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            foreach=False, **HYPER)
    losses, states, grads = [], [], None
    for mbs in data:
        loss = model(torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs]))
        loss.backward()
        if grads is None:
            grads = {model.global_name(n): p.grad.detach().clone() for n, p in model.named_parameters()}
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
        states.append({model.global_name(n): p.detach().clone() for n, p in model.named_parameters()})
    return losses, states, grads


def check_tied(model, grid):
    """The first stage's word embedding and the last stage's copy are bit-identical."""
    group = grid.embedding_group
    if group is None or group.size == 1:
        return
    w = model.word_embedding_weight.detach().contiguous()
    both = [torch.empty_like(w) for _ in range(2)]
    dist.all_gather(both, w, group=group.pg)
    assert torch.equal(both[0], both[1]), "tied embedding copies diverged"


def train_pipeline(cfg, grid, data, schedule, zero_stage=0, layers=None, clip=1.0, recompute=False,
                   precision="fp64"):
    """Build this rank's stage, one pipeline step per batch; returns (model, (losses, params, first gradients))."""
    from zerotron.zero import ZeroConfig, ZeroOptimizer

    model = build_stage(cfg, grid, layers, seed=SEED, dtype=DTYPES[precision])
    events = []  # "F" per stage forward, "B" per backward (first gradient of the stage's last block)
    model.register_forward_pre_hook(lambda *_: events.append("F"))
    model.blocks[-1].ln2.weight.register_post_accumulate_grad_hook(lambda _: events.append("B"))
    calls = [0]
    if recompute == "zerotron":  # ZeRO-R checkpointing with Pa and MD buffers sized for the schedule
        from zerotron.activation.checkpoint import apply_activation_checkpointing
        from zerotron.activation.config import ActivationCheckpointConfig
        ac = ActivationCheckpointConfig(checkpoint_activations=True, partition_activations=True,
                                        contiguous_memory_optimization=True)
        in_flight = microbatches_in_flight(schedule, grid.pp_size, grid.pp_rank, len(data[0]))
        apply_activation_checkpointing(model, grid, ac, microbatches_in_flight=in_flight)
        assert model.block_runner is not None
    elif recompute:  # torch checkpointing inside the stage: the schedule must not care
        for blk in model.blocks:
            def fwd(x, f=blk.forward):
                calls[0] += 1
                return f(x)
            blk.forward = lambda x, f=fwd: torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False)
    if zero_stage is None:  # plain torch AdamW, no DP (dp = 1 here), no clipping
        opt = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.ndim >= 2]},
                                 {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                                foreach=False, **HYPER)
    else:
        opt = ZeroOptimizer(model, grid, ZeroConfig(stage=zero_stage), clip_grad=clip, precision=precision,
                                **HYPER)
    sl = slice(grid.dp_rank * MICRO, (grid.dp_rank + 1) * MICRO)
    losses, states, grads = [], [], None
    for mbs in data:
        mark = grid.stats.snapshot()
        out = pipeline_step(model, [(x[sl], y[sl]) for x, y in mbs], None if zero_stage is None else opt,
                            schedule=schedule)
        m = len(mbs)
        assert events == expected_order(schedule, grid, m), (schedule, events)
        events.clear()
        sends = grid.stats.since(mark).get("send", "pp").calls
        assert sends == m * ((not grid.is_last_stage) + (not grid.is_first_stage)), sends
        if grads is None and zero_stage in (0, None):  # the whole reduced gradient is in .grad
            grads = {model.global_name(n): p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        if zero_stage is None:
            opt.zero_grad(set_to_none=True)
        check_tied(model, grid)
        losses.append(out.loss.detach().clone())
        states.append({model.global_name(n): p.detach().clone() for n, p in model.named_parameters()})
    if recompute is True:
        assert calls[0] == 2 * len(data) * len(data[0]) * len(model.blocks), calls  # forward + recompute
    return model, (losses, states, grads)


def expected_order(schedule, grid, m):
    """AFAB: m forwards then m backwards; 1F1B: pp - r - 1 warm-up forwards, F B pairs, drain."""
    if schedule == "afab":
        return ["F"] * m + ["B"] * m
    warmup = min(grid.pp_size - grid.pp_rank - 1, m)
    return ["F"] * warmup + ["F", "B"] * (m - warmup) + ["B"] * warmup


def local(model, grid, state, name, p):
    """This rank's slice of the full reference tensor of parameter ``name``."""
    full = state[model.global_name(name)]
    dim = shard_info(p, name).tp_split_dim
    return full if dim is None else full.chunk(grid.tp_size, dim=dim)[grid.tp_rank]


def compare_fp64(model, grid, run, truth, what):
    """Loss and every parameter slice after every step, float64 against the float64 reference."""
    for step in range(STEPS):
        assert_fp64(run[0][step], truth[0][step], FP64_TP_PP, f"{what} step {step}: loss")
        for name, p in model.named_parameters():
            assert_fp64(run[1][step][model.global_name(name)], local(model, grid, truth[1][step], name, p),
                        FP64_TP_PP, f"{what} step {step}: {name}")


def compare_fp32_grads(model, grid, run, truth, torch32, what):
    """First-step gradient of every parameter slice, fp32, within twice torch fp32's own error."""
    for name, p in model.named_parameters():
        assert_fp32(run[2][model.global_name(name)], local(model, grid, truth[2], name, p),
                    local(model, grid, torch32[2], name, p), f"{what}: gradient of {name}")


def check_runs(grid, runs):
    """runs: (num_layers, schedule, m, zero_stage, layers_per_stage, clip, recompute)."""
    ref_grid = Grid(ParallelDims())  # tp = pp = 1: the whole model on every rank
    fp32_done = set()
    for num_layers, schedule, m, zero_stage, layers, clip, recompute in runs:
        cfg = make_cfg(num_layers)
        data = make_data(cfg, m, grid.dp_size)
        what = f"tp={grid.tp_size} pp={grid.pp_size} dp={grid.dp_size} {schedule} m={m} zero={zero_stage}"
        truth = reference(cfg, data, ref_grid, clip, "fp64")
        model, run = train_pipeline(cfg, grid, data, schedule, zero_stage, layers, clip, recompute, "fp64")
        compare_fp64(model, grid, run, truth, f"fp64 {what}")
        fp32_run = (num_layers, schedule, m, None if zero_stage is None else 0, str(layers), recompute)
        if fp32_run in fp32_done:  # runs differing only in ZeRO stage 1 / 2 share their fp32 gradient check
            continue
        fp32_done.add(fp32_run)
        torch32 = reference(cfg, data[:1], ref_grid, clip, "fp32")
        model, run = train_pipeline(cfg, grid, data[:1], schedule, fp32_run[3], layers, clip, recompute,
                                    "fp32")  # stage 0 keeps the whole reduced gradient in .grad
        compare_fp32_grads(model, grid, run, truth, torch32, f"fp32 {what}")
    return True


def check_pp(pp, runs):
    return check_runs(Grid(ParallelDims(tp=1, pp=pp)), runs)


def test_pp2_1f1b_and_afab_equal_reference():
    runs = [(3, "1f1b", 4, 0, None, 1.0, False),       # uneven default split: 2, 1
            (3, "1f1b", 8, 1, [1, 2], 0.05, False),     # explicit split, clipping active, Pos
            (2, "afab", 4, 0, None, 1.0, False),
            (2, "afab", 8, None, None, None, False)]    # plain torch AdamW: no optimizer contract
    assert all(spawn(check_pp, 2, 2, runs, timeout=120))


def test_pp4_1f1b_and_afab_equal_reference():
    runs = [(4, "1f1b", 4, 0, None, 1.0, False),
            (5, "1f1b", 8, 2, None, 1.0, False),         # 2, 1, 1, 1; Pos+g, dp = 1
            (4, "afab", 8, 0, None, 1.0, False),
            (4, "1f1b", 4, 0, None, 1.0, True),          # with activation checkpointing
            (4, "1f1b", 2, 0, None, 1.0, False)]         # m < pp: stage 0 never reaches steady state
    assert all(spawn(check_pp, 4, 4, runs, timeout=120))


def check_3d():
    grid = Grid(ParallelDims(tp=2, pp=2, dp=2))
    check_runs(grid, [(4, "1f1b", 4, 1, None, 1.0, False), (4, "1f1b", 4, 2, None, 1.0, False),
                      (3, "1f1b", 4, 2, None, 1.0, "zerotron"),  # + Pa, MD
                      (3, "afab", 4, 1, [1, 2], 1.0, False)])
    # Pos+g+p with pipelines is refused on every rank, before any p2p.
    from zerotron.zero import ZeroConfig, ZeroOptimizer
    cfg = make_cfg(2)
    model = build_stage(cfg, grid, seed=SEED)
    opt = ZeroOptimizer(model, grid, ZeroConfig(stage=3), **HYPER)
    data = make_data(cfg, 2, 2)[0]
    with pytest.raises(ValueError, match="zero.stage=3"):
        pipeline_step(model, data, opt)
    return True


def test_tp2_pp2_dp2_zero1_and_zero2_equal_reference():
    assert all(spawn(check_3d, 8, timeout=180))


def test_split_rule_and_errors():
    assert split_layers(10, 4) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]  # earlier stages take the extra
    assert split_layers(4, 2) == [[0, 1], [2, 3]]
    assert split_layers(5, 2, [1, 4]) == [[0], [1, 2, 3, 4]]
    with pytest.raises(ValueError, match="parallel.pp=5 exceeds model.num_layers=4"):
        split_layers(4, 5)
    with pytest.raises(ValueError, match="sums to 3"):
        split_layers(4, 2, [1, 2])
    with pytest.raises(ValueError, match="2 entries but parallel.pp=3"):
        split_layers(4, 3, [2, 2])
    with pytest.raises(ValueError, match="positive integer"):
        split_layers(4, 2, [0, 4])


def test_without_a_pipeline_one_micro_batch_is_in_flight():
    """At pp = 1 the step runs forward and backward per micro-batch whatever the schedule says, so
    the MD checkpoint buffer is sized for one (it was m slots under ``afab``)."""
    from zerotron.parallel.pipeline_schedules import microbatches_in_flight

    assert microbatches_in_flight("afab", 1, 0, 8) == microbatches_in_flight("1f1b", 1, 0, 8) == 1
    assert microbatches_in_flight("afab", 2, 0, 8) == 8
