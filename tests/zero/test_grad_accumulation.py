"""Gradient accumulation dtype (``ZeroConfig.grad_accum_dtype``; Megatron's fp32 ``main_grad``).

* Accuracy, DP 2, bf16 parameters, 16 micro-batches, 10 steps, stages 0-3: the reference runs the
  same bf16 forward/backward on the same slices and sums the micro-batch gradients in float64
  (truth) or in fp32, then steps torch's AdamW on fp32 masters. With fp32 accumulation zerotron's
  masters must be within twice the fp32 reference's error of the truth (+1e-7: one fp32 ulp at
  the weights' scale); with bf16 accumulation they must be over 10x further off (measured here:
  ~10^4x; rounding every addend to 8 mantissa bits moves Adam's steps by ~0.5%, and then the bf16
  parameters).
  Clipping off and torch's single-tensor AdamW arithmetic (``FlatAdamW(prefer_fused=False)``), so
  the only difference left is the accumulation.
* Pipelines, PP 2, bf16 with fp32 accumulation, stages 0-1: ``param.grad`` is empty there (the
  16-bit gradients went into the fp32 buffer), so the tied embedding's gradients are summed
  through ``ZeroOptimizer.tied_grad``: both copies stay bit-identical.
* ``zero.grad_accum_dtype`` validation against the precision, and DeepSpeed's
  ``data_types.grad_accum_dtype``.
"""

import pytest
import torch

from tests.harness import spawn
from tests.zero.common import HYPER, batches, zero_train
from tests.zero.models import TinyLM

STEPS, MICRO, PER_RANK = 10, 16, 2


def _reference(data, dp: int, accum: torch.dtype) -> dict:
    """bf16 forward/backward per DP slice and micro-batch, gradients summed in ``accum``, AdamW on fp32."""
    model = TinyLM()
    masters = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    model = model.to(torch.bfloat16)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [m for m in masters if m.ndim >= 2]},
                             {"params": [m for m in masters if m.ndim < 2], "weight_decay": 0.0}],
                            foreach=False, **HYPER)
    for mbs in data:
        acc = [torch.zeros(p.shape, dtype=accum) for p in params]
        for x, y in mbs:
            for r in range(dp):
                sl = slice(r * PER_RANK, (r + 1) * PER_RANK)
                grads = torch.autograd.grad(model(x[sl], y[sl]) / len(mbs), params)
                for a, g in zip(acc, grads):
                    a += g.to(accum) / dp
        for m, a in zip(masters, acc):
            m.grad = a.float()
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    return {n: m.detach() for (n, _), m in zip(model.named_parameters(), masters)}


def check_accumulation_accuracy():
    from zerotron.parallel import Grid, ParallelDims
    from zerotron.zero import ZeroConfig, ZeroOptimizer
    from zerotron.zero.adam import FlatAdamW

    grid = Grid(ParallelDims())
    data = batches(STEPS, MICRO, grid.dp_size, per_rank=PER_RANK)
    # the two references are independent: rank 0 computes the float64 one, rank 1 the fp32 one
    mine = _reference(data, grid.dp_size, torch.float64 if grid.dp_rank == 0 else torch.float32)
    both = [None] * grid.dp_size
    torch.distributed.all_gather_object(both, mine)
    truth, ref32 = both[0], both[1]

    def err(final):
        return max((final[n].double() - truth[n].double()).abs().max().item() for n in truth)

    bound = 2 * err(ref32) + 1e-7
    errors = {}
    for stage, accum in ((0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (0, "bf16"), (2, "bf16")):
        model = TinyLM()
        cfg = ZeroConfig(stage=stage, reduce_bucket_size=500, allgather_bucket_size=500,
                         stage3_param_persistence_threshold=0, grad_accum_dtype=accum)
        opt = ZeroOptimizer(model, grid, cfg, clip_grad=None, precision="bf16", **HYPER)
        opt.adam = FlatAdamW(opt.state.device, prefer_fused=False)  # torch's single-tensor arithmetic
        assert opt.reducer.dtype == (torch.float32 if accum == "fp32" else torch.bfloat16)
        zero_train(model, opt, data, grid.dp_rank, per_rank=PER_RANK)
        errors[(stage, accum)] = err(dict(opt.full_params()))
    for (stage, accum), e in errors.items():
        if accum == "fp32":
            assert e <= bound, f"stage {stage} fp32 accumulation: error {e:.3g} > {bound:.3g} (errors {errors})"
        else:
            assert e > 10 * bound, f"stage {stage} bf16 accumulation: error {e:.3g} not >> {bound:.3g}"
    return errors


def test_fp32_accumulation_of_bf16_gradients_matches_the_fp32_reference():
    errors = spawn(check_accumulation_accuracy, 2, timeout=300)[0]
    print({k: f"{v:.3g}" for k, v in errors.items()})


def check_pipeline_tied_embedding():
    import torch.distributed as dist

    from zerotron.model import GPTConfig
    from zerotron.model.stages import build_stage, pipeline_step
    from zerotron.parallel import Grid, ParallelDims
    from zerotron.zero import ZeroConfig, ZeroOptimizer

    grid = Grid(ParallelDims(pp=2))
    cfg = GPTConfig(num_layers=2, hidden_size=16, num_heads=2, vocab_size=64, seq_length=8)
    g = torch.Generator().manual_seed(5)
    for stage in (0, 1):
        model = build_stage(cfg, grid, seed=3)
        opt = ZeroOptimizer(model, grid, ZeroConfig(stage=stage), clip_grad=1.0, precision="bf16", **HYPER)
        weight = model.word_embedding_weight
        for _ in range(2):
            data = [(torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g))
                    for _ in range(4)]
            pipeline_step(model, data, opt)
            assert weight.grad is None  # the 16-bit gradients went into the fp32 buffer
            summed = opt.tied_grad(weight)
            assert summed.dtype == torch.float32 and summed.abs().sum() > 0
            both = [torch.empty_like(summed) for _ in range(2)]
            dist.all_gather(both, summed.contiguous(), group=grid.embedding_group.pg)
            assert torch.equal(both[0], both[1]), f"stage {stage}: tied gradients differ"
            opt.step()
            w = weight.detach().contiguous()
            both = [torch.empty_like(w) for _ in range(2)]
            dist.all_gather(both, w, group=grid.embedding_group.pg)
            assert torch.equal(both[0], both[1]), f"stage {stage}: tied embedding copies diverged"
    return True


def test_pipeline_sums_tied_embedding_gradients_in_the_fp32_buffer():
    assert all(spawn(check_pipeline_tied_embedding, 2, timeout=120))


def test_grad_accum_dtype_validation_and_deepspeed_reader():
    from zerotron.config.deepspeed import from_deepspeed
    from zerotron.zero import ZeroConfig

    for precision, want in (("bf16", "fp32"), ("fp16", "fp32"), ("fp32", "fp32"), ("fp64", "fp64")):
        assert ZeroConfig().validate(precision=precision).grad_accum(precision) == want
    assert ZeroConfig(grad_accum_dtype="bf16").validate(precision="bf16").grad_accum("bf16") == "bf16"
    assert ZeroConfig(grad_accum_dtype="fp32").validate(precision="fp16").grad_accum("fp16") == "fp32"
    for value, precision, match in (("fp8", None, "use one of"), ("fp16", "bf16", "mixes two 16-bit"),
                                    ("bf16", "fp32", "accumulate in fp32"), ("fp32", "fp64", "accumulate in fp64")):
        with pytest.raises(ValueError, match=rf"zero\.grad_accum_dtype='{value}': .*{match}"):
            ZeroConfig(grad_accum_dtype=value).validate(precision=precision)

    def accum(ds: dict):
        return from_deepspeed(ds)[0].zero.grad_accum_dtype

    assert accum({"data_types": {"grad_accum_dtype": "fp32"}}) == "fp32"
    assert accum({"data_types": {"grad_accum_dtype": "bfloat16"}}) == "bf16"
    assert accum({"bf16": {"enabled": True}}) is None
    assert accum({"data_types": {"grad_accum_dtype": None}}) is None
    with pytest.raises(ValueError, match=r"data_types\.grad_accum_dtype='int8'"):
        accum({"data_types": {"grad_accum_dtype": "int8"}})
    with pytest.raises(ValueError, match=r"data_types\.bogus"):
        accum({"data_types": {"bogus": 1}})
