"""Pipeline-mode gradient accumulation and reshardable partition state, DP 2, fp32.

* ``no_sync`` + ``scale_loss(...).backward()`` + ``reduce_gradients()`` (what the pipeline engine
  does) gives the same parameters as ``opt.backward`` and as the AdamW reference, stages 0-3.
* ``partition_index``/``partition_state`` saved by a stage-1 optimizer after 2 steps are loaded
  through ``load_partition_state(read_fn)`` into a stage-3 optimizer with different bucket sizes
  (a different flat layout); 3 more steps equal the reference's 5 steps.
"""

import os
import tempfile

import torch

from tests.harness import spawn
from tests.zero.common import HYPER, batches, reference_train, zero_train
from tests.zero.models import TinyLM
from tests.zero.test_equivalence import make_cfg

ATOL = 1e-6

STEPS, MICRO = 5, 2


def _assert_matches(opt, ref_params, what):
    for name, value in opt.full_params():
        err = (value - ref_params[name]).abs().max().item()
        assert err <= ATOL, f"{what}: {name} off by {err}"


def check_pipeline_mode_and_resharding(tmp):
    from zerotron.parallel import Grid, ParallelDims
    from zerotron.parallel import collectives as C
    from zerotron.zero import ZeroOptimizer

    grid = Grid(ParallelDims())
    rank, dp = grid.dp_rank, grid.dp_size
    data = batches(STEPS, MICRO, dp)
    ref, _ = reference_train(TinyLM(), data)
    ref_params = {n: p.detach() for n, p in ref.named_parameters()}
    sl = slice(rank * 2, rank * 2 + 2)

    for stage in (0, 1, 2, 3):
        model = TinyLM()
        opt = ZeroOptimizer(model, grid, make_cfg(stage), clip_grad=1.0, **HYPER)
        for mbs in data:
            with opt.no_sync():
                for x, y in mbs:
                    opt.scale_loss(model(x[sl], y[sl]) / len(mbs)).backward()
            before = grid.stats.total("dp").calls
            opt.reduce_gradients()
            assert grid.stats.total("dp").calls > before or dp == 1
            opt.step()
        _assert_matches(opt, ref_params, f"no_sync stage {stage}")

    # save after 2 steps with stage 1 ...
    model = TinyLM()
    opt = ZeroOptimizer(model, grid, make_cfg(1), clip_grad=1.0, **HYPER)
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
                buf = full.setdefault((name, key), torch.full((ref_params[name].numel(),), float("nan")))
                buf[start:end] = t[off:off + end - start]
    model = TinyLM()
    opt = ZeroOptimizer(model, grid, make_cfg(3, reduce_bucket_size=500, allgather_bucket_size=700), clip_grad=1.0,
                        **HYPER)
    opt.load_partition_state(lambda name, key, start, end: full[(name, key)][start:end],
                             step=saved[0]["step"], loss_scaler=saved[0]["scaler"])
    assert all(not torch.isnan(v).any() for v in full.values())
    zero_train(model, opt, data[2:], rank)
    _assert_matches(opt, ref_params, "resharded stage 1 -> stage 3")
    return True


def test_pipeline_mode_and_resharded_partition_state():
    with tempfile.TemporaryDirectory() as tmp:
        assert all(spawn(check_pipeline_mode_and_resharding, 2, tmp, timeout=150))
