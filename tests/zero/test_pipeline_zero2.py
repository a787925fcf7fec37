"""Pos+g (ZeRO §5.2) with pipelines, PP 2 x DP 2 (4 gloo ranks): no full gradient across micro-batches.

The schedule runs every micro-batch's backward through ``ZeroOptimizer.pipeline_backward``; at
stage 2 it reduces the buckets into the gradient partition as they fill, so autograd's gradients
live only until their bucket is packed, and the tied embedding's copies are summed as reduced
shards (the tied weight is the first layout group on both stages, so the shards line up).

* float64 (``tests/parity.py``, ``FP64_TP_PP``): 1F1B and AFAB (with zerotron's reentrant
  activation checkpointing) against the single-process reference of ``tests/parallel/test_pipeline``.
* memory, bf16 with fp32 accumulation: during every backward the live 16-bit autograd gradients
  stay below ``2 * (3 * bucket + largest parameter)`` bytes (a bucket being filled, one in flight,
  straddlers) -- well under the stage's 2Ψ they reached when every backward ran under ``no_sync``
  and one reduction came at the end -- and between micro-batches only the fp32 partition is
  resident: ``grads == 4 * part_numel``, about 4Ψ/Nd.
"""

import torch

from tests.harness import spawn
from tests.zero.common import HYPER

BUCKET = 512


def check_fp64_equals_reference():
    from tests.parallel.test_pipeline import check_runs
    from zerotron.parallel import Grid, ParallelDims

    grid = Grid(ParallelDims(pp=2))
    assert grid.dp_size == 2
    return check_runs(grid, [(3, "1f1b", 4, 2, None, 1.0, False), (2, "afab", 4, 2, None, 1.0, "zerotron")])


def test_pp2_dp2_zero2_equals_reference_in_float64():
    assert all(spawn(check_fp64_equals_reference, 4, timeout=240))


def check_resident_gradients():
    from zerotron.model import GPTConfig
    from zerotron.model.stages import build_stage, pipeline_step
    from zerotron.parallel import Grid, ParallelDims
    from zerotron.zero import ZeroConfig, ZeroOptimizer

    grid = Grid(ParallelDims(pp=2))
    cfg = GPTConfig(num_layers=4, hidden_size=32, num_heads=2, vocab_size=64, seq_length=8)
    model = build_stage(cfg, grid, seed=3)
    opt = ZeroOptimizer(model, grid, ZeroConfig(stage=2, reduce_bucket_size=BUCKET, allgather_bucket_size=BUCKET),
                        clip_grad=1.0, precision="bf16", **HYPER)
    params = [p for p in model.parameters() if p.requires_grad]
    peak = [0]

    def sample(_):
        live = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
        live += sum(t.numel() * t.element_size() for t in opt.reducer.late.values())
        peak[0] = max(peak[0], live)

    for p in params:
        p.register_post_accumulate_grad_hook(sample)
    g = torch.Generator().manual_seed(grid.dp_rank)
    for _ in range(2):
        data = [(torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g))
                for _ in range(4)]
        pipeline_step(model, data, opt)
        assert all(p.grad is None for p in params) and not opt.reducer.late
        mem = opt.memory_report()
        assert mem["grads"] == 4 * opt.layout.part_numel, mem
        info = opt.step()
        assert not info["skipped"]
    psi = opt.num_params
    bound = 2 * (3 * BUCKET + max(p.numel() for p in params))
    assert peak[0] <= bound < 2 * psi, (peak[0], bound, 2 * psi)
    assert opt.layout.part_numel <= psi / grid.dp_size + len(opt.layout.chunks) * grid.dp_size
    return peak[0], bound, 2 * psi


def test_pp2_dp2_zero2_keeps_only_the_partition_and_buckets():
    for peak, bound, full in spawn(check_resident_gradients, 4, timeout=120):
        print(f"peak live 16-bit gradients {peak} B <= {bound} B (2 psi = {full} B)")
