"""Interleaved 1F1B (``parallel.virtual_stages``) and the pipeline programs, on paper and on gloo ranks.

On paper (no processes): every program of AFAB, 1F1B and interleaved 1F1B for p <= 8, v <= 4 and
m up to 4p runs in ``pipeline_sim``'s model of NCCL (one in-order stream of batched transfers per
rank, rendezvous sends): nothing deadlocks, every receive gets its own message, and the
event-driven idle fraction of every rank equals the closed form (p-1)/(v·m+p-1) -- the bubble
the interleaving promises -- as the in-flight count equals ``microbatches_in_flight``. The model
is shown to fail where it should: a program that gloo would run but NCCL would not deadlocks
there, and a pair of swapped sends is caught.

On gloo ranks, against the single-process GPT trained by ``torch.optim.AdamW`` on the full
batch (``tests/parallel/test_pipeline.reference``, every rank computes it):

* TP 2 x PP 2 x v 2 x DP 2 (ZeRO-1) and TP 2 x PP 4 x v 2 (ZeRO-2, ZeRO-R checkpointing with Pa
  and MD): fp32 losses over 20 steps within rtol 1e-5 of torch's fp32 run (the fp32 noise of two
  correct implementations, ~1e-6 here, while a lost micro-batch or chunk moves a loss by > 1e-2);
  the float64 tier (``FP64_TP_PP``) for every gradient slice of a first step.
* bf16 (ZeRO-2) and fp16 (ZeRO-1, dynamic loss scale): PP 2 x v 2 bit-identical to PP 2 x v 1
  over 3 steps -- the same per-layer arithmetic on other ranks; clipping off, whose norm sums in
  another order. ZeRO-2 reduces only the buckets a chunk's backward reached: its DP bytes stay
  under 1.5x those of v 1 (straddling buckets go twice; reducing every bucket was 1.9x).
* eval of the interleaved stage = the reference model's loss (float64).
* a checkpoint written at PP 2 x v 2 (DP 2) loads into PP 1 (DP 4) and PP 4 x v 1 (DP 1): the next
  two float64 losses of all three equal the reference's uninterrupted run.

And the GPU clock: compute and step time from CUDA events, read with one counted host sync.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.harness import spawn
from tests.parallel.test_pipeline import MICRO, SEED, check_tied, local, make_cfg, make_data, reference
from tests.parity import FP64_TP_PP, assert_fp64
from zerotron.parallel.pipeline_schedules import (Batch, Msg, Op, bubble_fraction, check_schedule,
                                                  microbatches_in_flight, program)
from zerotron.parallel.pipeline_sim import ScheduleError, simulate

# torch.optim imports torch._dynamo on first use: seconds of start-up in every forked rank that
# builds the reference, unless the parent has it already (fork shares it); threads start nowhere.
import torch._dynamo  # noqa: E402,F401


def _configs():
    for schedule, p, v, k in itertools.product(("1f1b", "afab"), (2, 3, 4, 8), (1, 2, 3, 4), (1, 2, 3, 4)):
        if v > 1 and schedule == "afab":
            continue
        for m in ((k * p,) if v > 1 else (k, k * p)):
            yield schedule, p, v, m


def test_every_program_runs_on_nccls_ordering_with_the_formula_bubble():
    for schedule, p, v, m in _configs():
        what = f"{schedule} p={p} v={v} m={m}"
        for release in (True, False):  # free_outputs on / off
            res = simulate([program(schedule, p, r, m, v) for r in range(p)], 1.0 / v, 2.0 / v, release)
            for r in range(p):
                assert abs(res.idle(r) - bubble_fraction(schedule, p, m, v)) < 1e-9, (what, r, res.idle(r))
                assert res.peak_in_flight[r] == microbatches_in_flight(schedule, p, r, m, v), (what, r)
        simulate([program(schedule, p, r, m, v, forward_only=True) for r in range(p)], release_sends=False)  # eval
    # the closed form the bench is held to: p 4, v 2, m 8
    assert bubble_fraction("1f1b", 4, 8, 2) == pytest.approx(3 / 19)


def test_the_nccl_model_refuses_what_nccl_would_not_run():
    def a(send, peer):
        return Msg(send, "A", 0, 0, peer, 0)

    def g(send, peer):
        return Msg(send, "G", 0, 0, peer, 0)

    # rank 0 waits for a gradient before the send its peer needs first: gloo copes, one stream does not
    rank0 = [Op("F", 0, 0), Batch((g(False, 1),)), Batch((a(True, 1),)), Op("B", 0, 0)]
    rank1 = [Batch((a(False, 0),)), Op("F", 0, 0), Op("B", 0, 0), Batch((g(True, 0),))]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate([rank0, rank1])
    rank0 = [Op("F", 0, 0), Batch((a(True, 1), g(False, 1))), Op("B", 0, 0)]  # the right order runs
    assert simulate([rank0, rank1]).makespan == 6.0  # F, transfer, F B on rank 1, then B
    progs = [program("1f1b", 2, r, 4, 2) for r in range(2)]
    i = next(i for i, x in enumerate(progs[1]) if isinstance(x, Batch) and x.msgs[0].send)
    j = next(j for j, x in enumerate(progs[1]) if j > i and isinstance(x, Batch) and x.msgs[0].send)
    progs[1][i], progs[1][j] = progs[1][j], progs[1][i]  # two sends to rank 0 swapped
    with pytest.raises(ScheduleError, match="in that order|deadlock"):
        simulate(progs)


def test_bad_interleaving_is_refused_naming_the_field():
    from zerotron.model.stages import split_chunks
    from zerotron.parallel import ParallelDims
    from zerotron.config.run_config import ConfigError, RunConfig

    with pytest.raises(ValueError, match="multiple of parallel.pp=4"):
        check_schedule("1f1b", 4, 6, 2)
    with pytest.raises(ValueError, match="pipeline_schedule=1f1b"):
        check_schedule("afab", 2, 4, 2)
    with pytest.raises(ValueError, match="parallel.virtual_stages=2 is the interleaved"):
        ParallelDims(pp=1, virtual_stages=2).resolve(1)
    with pytest.raises(ValueError, match="parallel.virtual_stages=0"):
        ParallelDims(pp=2, virtual_stages=0).resolve(2)
    with pytest.raises(ValueError, match=r"pp\*parallel.virtual_stages=2\*4=8 exceeds model.num_layers=4"):
        split_chunks(4, 2, None, 4)
    assert split_chunks(6, 2, None, 2) == [[[0, 1], [4]], [[2, 3], [5]]]  # virtual stages of 2, 2, 1, 1
    cfg = RunConfig(parallel=ParallelDims(pp=2, virtual_stages=2))
    cfg.training.micro_batch_size, cfg.training.global_batch_size = 2, 6  # 3 micro-batches on 2 ranks
    with pytest.raises(ConfigError, match="global_batch_size of a multiple of 4"):
        cfg.validate(2)


def test_gpu_clock_reads_cuda_events_once_and_only_when_asked(monkeypatch):
    """On a GPU the bubble comes from CUDA events (host time around an asynchronous launch is not
    compute): the clock adds the event spans, and resolves them with one counted host sync."""
    from zerotron.parallel import host_sync
    from zerotron.parallel.pipeline_clock import Clock

    now, syncs = [0.0], []

    class Event:  # a stream clock that advances 1 ms per record
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.t = None

        def record(self):
            now[0] += 1.0
            self.t = now[0]

        def synchronize(self):
            syncs.append(self.t)

        def elapsed_time(self, end):
            return end.t - self.t

    monkeypatch.setattr(host_sync, "event", Event)
    clock = Clock(torch.device("cuda"))  # start: t 1
    for _ in range(3):
        with clock.compute():  # t 2 -> 3, 4 -> 5, 6 -> 7
            pass
    clock.stop()  # t 8
    with host_sync.counting() as counted:
        assert not syncs
        assert clock.compute_s() == pytest.approx(3e-3) and clock.wall_s() == pytest.approx(7e-3)
        assert clock.compute_s() == pytest.approx(3e-3)
    assert syncs == [8.0] and counted.by_reason == {"pipeline_clock": 1}


# gloo ranks --------------------------------------------------------------------------------------
def _run_cfg(layers, precision, zero_stage, m, dp, clip=1.0, checkpointing=False):
    from zerotron.testing.zero_runs import HYPER
    from zerotron.config.run_config import RunConfig
    from zerotron.zero import ZeroConfig

    run = RunConfig()
    run.zero = ZeroConfig(stage=zero_stage, reduce_bucket_size=2000, allgather_bucket_size=2000)
    t, o = run.training, run.optimizer
    t.seed, t.precision, t.micro_batch_size, t.global_batch_size = SEED, precision, MICRO, MICRO * m * dp
    o.lr, (o.beta1, o.beta2), o.eps, o.weight_decay, o.clip_grad = (HYPER["lr"], HYPER["betas"], HYPER["eps"],
                                                                     HYPER["weight_decay"], clip)
    ac = run.activation_checkpointing
    ac.checkpoint_activations = ac.partition_activations = ac.contiguous_memory_optimization = checkpointing
    return run, make_cfg(layers)


def _build(grid, run, mcfg, v):
    import dataclasses

    from zerotron.parallel import Grid
    from zerotron.training.parallelize import parallelize_gpt

    dims = dataclasses.replace(grid.dims, virtual_stages=v)
    run.parallel = dataclasses.replace(run.parallel, tp=dims.tp, pp=dims.pp, dp=None, virtual_stages=v)
    run.validate(grid.world_size)
    view = grid if dims == grid.dims else Grid(dims)
    return view, parallelize_gpt(run, mcfg, view)


def _train(grid, plan, data, steps):
    from zerotron.training.step import run_step

    sl = slice(grid.dp_rank * MICRO, (grid.dp_rank + 1) * MICRO)
    losses = []
    for mbs in data[:steps]:
        res = run_step(plan.model, plan.optimizer, [(x[sl], y[sl]) for x, y in mbs], grid)
        check_tied(plan.model, grid)
        losses.append(res.loss_sum.detach().clone())
    return torch.stack(losses)


def _fp32_and_fp64(grid, layers, m, zero_stage, checkpointing, steps=20):
    """fp32 losses over ``steps`` against torch fp32; float64 gradients of one step against float64."""
    from zerotron.model.stages import pipeline_step
    from zerotron.parallel import Grid, ParallelDims

    ref_grid = Grid(ParallelDims())
    mcfg = make_cfg(layers)
    data = make_data(mcfg, m, grid.dp_size) * (steps // 3 + 1)
    torch32 = reference(mcfg, data[:steps], ref_grid, 1.0, "fp32")
    run, _ = _run_cfg(layers, "fp32", zero_stage, m, grid.dp_size, checkpointing=checkpointing)
    _, plan = _build(grid, run, mcfg, 2)
    assert plan.model.chunk_sizes == [layers // (2 * grid.pp_size)] * 2
    got = _train(grid, plan, data, steps)
    want = torch.stack(torch32[0])
    err = ((got - want).abs() / want.abs()).max().item()
    assert err <= 1e-5, f"fp32 losses over {steps} steps: rtol {err:.2g} > 1e-5"
    truth = reference(mcfg, data[:1], ref_grid, 1.0, "fp64")
    run, _ = _run_cfg(layers, "fp64", 0, m, grid.dp_size)
    _, plan = _build(grid, run, mcfg, 2)
    sl = slice(grid.dp_rank * MICRO, (grid.dp_rank + 1) * MICRO)
    out = pipeline_step(plan.model, [(x[sl], y[sl]) for x, y in data[0]], plan.optimizer)
    assert_fp64(out.loss, truth[0][0], FP64_TP_PP, "fp64 loss")
    for name, p in plan.model.named_parameters():  # stage 0: the whole reduced gradient is in .grad
        assert_fp64(p.grad, local(plan.model, grid, truth[2], name, p), FP64_TP_PP, f"fp64 gradient of {name}")
    return err


def _eval_matches(grid, layers, m):
    from zerotron.model import GPT
    from zerotron.parallel import Grid, ParallelDims
    from zerotron.parallel.pipeline import eval_step

    mcfg = make_cfg(layers)
    data = make_data(mcfg, m, grid.dp_size)[0]
    run, _ = _run_cfg(layers, "fp64", 1, m, grid.dp_size)
    _, plan = _build(grid, run, mcfg, 2)
    sl = slice(grid.dp_rank * MICRO, (grid.dp_rank + 1) * MICRO)
    mbs = [(x[sl], y[sl]) for x, y in data]
    got = eval_step(plan.model, mbs, grid, plan.model.hidden_shape(MICRO), dtype=torch.float64)
    ref = GPT(mcfg, Grid(ParallelDims()), seed=SEED, dtype=torch.float64).eval()
    with torch.no_grad():
        want = torch.stack([ref(x, y) for x, y in mbs]).mean()
    assert_fp64(got, want, FP64_TP_PP, "eval loss")


def _16bit_bitwise(grid, precision, zero_stage):
    mcfg = make_cfg(4)
    data = make_data(mcfg, 4, grid.dp_size)
    runs, dp_bytes = [], []
    for v in (1, 2):
        run, _ = _run_cfg(4, precision, zero_stage, 4, grid.dp_size, clip=0.0)
        view, plan = _build(grid, run, mcfg, v)
        mark = view.stats.snapshot()
        runs.append(_train(view, plan, data, 3))
        dp_bytes.append(view.stats.since(mark).total("dp").bytes)
    assert torch.equal(runs[0], runs[1]), f"{precision}: v=2 {runs[1].tolist()} != v=1 {runs[0].tolist()}"
    if zero_stage == 2:  # each chunk's backward reduces its own buckets only (1.9x when it reduced all)
        assert dp_bytes[1] < 1.5 * dp_bytes[0], dp_bytes


def check_eight_ranks():
    from zerotron.parallel import Grid, ParallelDims

    a = Grid(ParallelDims(tp=2, pp=2, virtual_stages=2))  # dp 2
    errs = [_fp32_and_fp64(a, 4, 4, 1, False)]
    _16bit_bitwise(a, "bf16", 2)
    _16bit_bitwise(a, "fp16", 1)
    b = Grid(ParallelDims(tp=2, pp=4, virtual_stages=2))  # dp 1
    errs.append(_fp32_and_fp64(b, 8, 4, 2, True))
    _eval_matches(b, 8, 4)
    return errs


def test_tp2_pp2_v2_dp2_and_tp2_pp4_v2_equal_the_single_process_run():
    for errs in spawn(check_eight_ranks, 8, timeout=240):
        print(f"fp32 loss rtol over 20 steps: PP2xv2 {errs[0]:.2g}, PP4xv2 {errs[1]:.2g}")


def check_checkpoint_reshards(tmp):
    from zerotron.parallel import Grid, ParallelDims
    from zerotron.parallel import collectives as C
    from zerotron.checkpoint.checkpointer import Checkpointer, RunIdentity
    from zerotron.checkpoint.distributed import load_checkpoint
    from zerotron.config.run_config import CheckpointSection

    mcfg = make_cfg(4)
    steps = 4
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, mcfg.vocab_size, (2, 8, mcfg.seq_length), generator=g)
               for _ in range(steps)]  # ids and labels of 8 sequences per step
    truth = reference(mcfg, [[(b[0], b[1])] for b in batches], Grid(ParallelDims()), 1.0, "fp64")[0]

    def data_for(grid, m):  # the global batch cut into m micro-batches per DP rank
        rows = batches[0].shape[1] // (m * grid.dp_size)
        out = []
        for b in batches:
            parts = [slice((j * grid.dp_size + grid.dp_rank) * rows, (j * grid.dp_size + grid.dp_rank + 1) * rows)
                     for j in range(m)]
            out.append([(b[0][s], b[1][s]) for s in parts])
        return out

    def layout(pp, v, m):
        grid = Grid(ParallelDims(pp=pp, virtual_stages=v))
        run, _ = _run_cfg(4, "fp64", 1, m, grid.dp_size)
        run.training.micro_batch_size = batches[0].shape[1] // (m * grid.dp_size)
        run.training.global_batch_size = batches[0].shape[1]
        return _build(grid, run, mcfg, v) + (data_for(grid, m),)

    def losses(grid, plan, data):
        from zerotron.training.step import run_step
        out = []
        for mbs in data:
            res = run_step(plan.model, plan.optimizer, mbs, grid)
            loss = res.loss_sum if res.dp_reduced else C.all_reduce(res.loss_sum.clone(), grid.dp_group, op="avg")
            out.append(loss.detach().clone())
        return torch.stack(out)

    grid, plan, data = layout(2, 2, 2)
    first = losses(grid, plan, data[:2])
    saver = Checkpointer(CheckpointSection(save=str(tmp)), grid, plan.optimizer.device,
                         RunIdentity("interleaved"))
    saver.track(plan.model, plan.optimizer, {})
    path = saver.save(2, consumed_samples=16)
    results = {"pp2 v2": torch.cat([first, losses(grid, plan, data[2:])])}
    for name, (pp, v, m) in {"pp1": (1, 1, 1), "pp4 v1": (4, 1, 4)}.items():
        grid, plan, data = layout(pp, v, m)
        load_checkpoint(str(path), plan.model, plan.optimizer, grid, model_config={}, log=lambda _: None)
        results[name] = torch.cat([first, losses(grid, plan, data[2:])])
    for name, got in results.items():
        assert_fp64(got, torch.stack(truth), FP64_TP_PP, f"{name}: losses of steps 1-4 (3-4 after the load)")
    return True


def test_checkpoint_of_pp2_v2_loads_into_pp1_and_pp4(tmp_path):
    assert all(spawn(check_checkpoint_reshards, 4, tmp_path, timeout=180))
