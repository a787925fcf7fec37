"""Pipeline-mode gradient accumulation and reshardable partition state, DP 2, against torch AdamW.

Reference: ``reference_train`` -- single process, full batch, ``clip_grad_norm_(1.0)``,
``torch.optim.AdamW`` -- on ``TinyLM``, 5 steps of 2 micro-batches.

* ``no_sync`` + ``scale_loss(...).backward()`` + ``reduce_gradients()`` (what the pipeline engine
  does) gives the reference's parameters, stages 0-3.
* ``partition_index``/``partition_state`` saved by a stage-1 optimizer after 2 steps are loaded
  through ``load_partition_state(read_fn)`` into a stage-3 optimizer with different bucket sizes
  (a different flat layout); 3 more steps equal the reference's 5 steps.

Tiers (``tests/parity.py``): float64 for both -- model, ``precision="fp64"`` ZeRO state and the
reference in float64, within ``FP64_ZERO``: ZeRO only repartitions the same DP sums, so float64
round-off stays below 1e-14, while a lost micro-batch, a skipped reduction or a master/moment range
loaded at the wrong offset moves a parameter by > 1e-4. The ``no_sync`` path also runs one step
in fp32: this rank's reduced gradient partition against the float64 reference's first gradient,
within twice torch fp32's own error on the same batch (``assert_fp32``). Gradients, not
parameters: Adam with eps 1e-8 turns the fp32 noise of near-eps gradient elements into parameter
differences whose size varies from batch to batch, in torch's run as in ours.
"""

import copy
import os
import tempfile

import torch

from tests.harness import spawn
from tests.parity import FP64_ZERO, assert_fp32, assert_fp64
from tests.zero.common import HYPER, batches, reference_train, zero_train
from tests.zero.models import TinyLM
from tests.zero.test_equivalence import make_cfg

STEPS, MICRO = 5, 2


def _first_gradient(model, data):
    """The reference's gradient of its first step (full batch, before clipping), by name."""
    mbs = data[0]
    model = copy.deepcopy(model)
    model(torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs])).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _no_sync_train(grid, stage, precision, data):
    """The pipeline engine's accumulation: every backward under no_sync, one reduce_gradients per step.

    Returns the final parameters and this rank's first reduced gradient as (name, start, end, values).
    """
    from zerotron.zero import ZeroOptimizer

    sl = slice(grid.dp_rank * 2, grid.dp_rank * 2 + 2)
    model = TinyLM().to(torch.float64 if precision == "fp64" else torch.float32)
    opt = ZeroOptimizer(model, grid, make_cfg(stage), clip_grad=1.0, precision=precision, **HYPER)
    pieces = None
    for mbs in data:
        with opt.no_sync():
            for x, y in mbs:
                opt.scale_loss(model(x[sl], y[sl]) / len(mbs)).backward()
        before = grid.stats.total("dp").calls
        opt.reduce_gradients()
        assert grid.stats.total("dp").calls > before or grid.dp_size == 1
        pieces = pieces or [(opt.names[p], start, end, opt.reducer.grad_shard(c)[off:off + end - start].clone())
                            for c in opt.layout.chunks for p, start, end, off in opt.layout.shard_pieces(c)]
        opt.step()
    return dict(opt.full_params()), pieces


def check_pipeline_mode_and_resharding(tmp):
    from zerotron.parallel import Grid, ParallelDims
    from zerotron.parallel import collectives as C
    from zerotron.zero import ZeroOptimizer

    grid = Grid(ParallelDims())
    rank, dp = grid.dp_rank, grid.dp_size
    data = batches(STEPS, MICRO, dp)
    truth = {n: p.detach() for n, p in reference_train(TinyLM().double(), data)[0].named_parameters()}
    truth_grad, torch32_grad = _first_gradient(TinyLM().double(), data), _first_gradient(TinyLM(), data)

    for stage in (0, 1, 2, 3):
        for name, value in _no_sync_train(grid, stage, "fp64", data)[0].items():
            assert_fp64(value, truth[name], FP64_ZERO, f"fp64 no_sync stage {stage}: {name}")
        for name, start, end, got in _no_sync_train(grid, stage, "fp32", data[:1])[1]:
            assert_fp32(got, truth_grad[name].reshape(-1)[start:end], torch32_grad[name].reshape(-1)[start:end],
                        f"fp32 no_sync stage {stage}: gradient of {name}[{start}:{end}]")

    # save after 2 steps with stage 1 ...
    model = TinyLM().double()
    opt = ZeroOptimizer(model, grid, make_cfg(1), clip_grad=1.0, precision="fp64", **HYPER)
    zero_train(model, opt, data[:2], rank)
    state = opt.partition_state()
    torch.save({"index": opt.partition_index(), "state": {k: state[k] for k in ("master", "exp_avg", "exp_avg_sq")},
                "step": state["step"], "scaler": state["loss_scaler"]}, os.path.join(tmp, f"rank{rank}.pt"))
    C.barrier(grid.world_group)
    # ... and load into stage 3 with other bucket sizes (another layout)
    saved = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=True) for r in range(dp)]
    full = {}
    for s in saved:
        for name, start, end, off in s["index"]:
            for key, t in s["state"].items():
                buf = full.setdefault((name, key), torch.full((truth[name].numel(),), float("nan"), dtype=t.dtype))
                buf[start:end] = t[off:off + end - start]
    model = TinyLM().double()
    opt = ZeroOptimizer(model, grid, make_cfg(3, reduce_bucket_size=500, allgather_bucket_size=700),
                        clip_grad=1.0, precision="fp64", **HYPER)
    opt.load_partition_state(lambda name, key, start, end: full[(name, key)][start:end],
                             step=saved[0]["step"], loss_scaler=saved[0]["scaler"])
    assert all(not torch.isnan(v).any() for v in full.values())
    zero_train(model, opt, data[2:], rank)
    for name, value in opt.full_params():
        assert_fp64(value, truth[name], FP64_ZERO, f"fp64 resharded stage 1 -> stage 3: {name}")
    return True


def test_pipeline_mode_and_resharded_partition_state():
    with tempfile.TemporaryDirectory() as tmp:
        assert all(spawn(check_pipeline_mode_and_resharding, 2, tmp, timeout=150))
