"""ZeRO stages 0-3 against a single-process torch.optim.AdamW reference, in the three tiers of
``tests/parity.py``.

Layouts: DP 1, 2, 4 (TP 1) with TinyLM, and TP 2 x DP 2 with TPTinyLM (hand-made Megatron MLP).
5 steps of 2 micro-batches; small buckets force several chunks per partition and parameters that
straddle chunks.

* bitwise: DP 1, every stage, clipping off, torch accumulating the same two micro-batches and
  stepping with its single-tensor AdamW, zerotron with the same arithmetic (``FlatAdamW`` without
  the fused kernel, whose vector/scalar split depends on where a tensor sits in the flat buffer):
  the parameters must be bit-identical.
* float64: every variant in float64 against torch's float64 AdamW on the full batch with
  ``clip_grad_norm_(1.0)``, to ``FP64_ZERO``.
* fp32: every variant in fp32 against the float64 truth, within twice torch fp32's own error.

Every variant also runs under ``tests/zero/inflight_guard.py``: no op writes into a buffer an
asynchronous collective (``overlap_comm``, stage-3 prefetch) is still using.
"""

import pytest
import torch

from tests.harness import spawn
from tests.parity import FP64_ZERO, assert_bitwise, assert_fp32, assert_fp64
from tests.zero.common import HYPER, batches, reference_train, zero_train
from tests.zero.inflight_guard import no_writes_into_inflight_collectives
from tests.zero.models import TinyLM, TPTinyLM, reference_name, tp_slice

STEPS, MICRO = 5, 2
# (stage, extra config): the four stages plus the variants that take other code paths
VARIANTS = [
    (0, {}), (1, {}), (2, {}), (3, {}),
    (0, {"contiguous_gradients": False, "overlap_comm": True}),
    (1, {"contiguous_gradients": False}),
    (2, {"overlap_comm": True, "offload_optimizer": True}),
    (3, {"overlap_comm": True, "offload_optimizer": True, "stage3_param_persistence_threshold": 0}),
]


def make_cfg(stage, **extra):
    from zerotron.zero import ZeroConfig

    kw = dict(stage=stage, reduce_bucket_size=300, allgather_bucket_size=300,
              stage3_param_persistence_threshold=20, stage3_prefetch_bucket_size=2000)
    kw.update(extra)
    return ZeroConfig(**kw)


def run_variants(grid, tp, variants, precision, data):
    """Every variant trained from the same TinyLM weights; yields (stage, extra, {name: final param})."""
    from zerotron.zero import ZeroOptimizer

    dtype = torch.float64 if precision == "fp64" else torch.float32
    for stage, extra in variants:
        model = TinyLM().to(dtype)
        model = model if tp == 1 else TPTinyLM(model, grid)
        opt = ZeroOptimizer(model, grid, make_cfg(stage, **extra), clip_grad=1.0, precision=precision, **HYPER)
        with no_writes_into_inflight_collectives() as races:
            infos, _ = zero_train(model, opt, data, grid.dp_rank)
        assert not races, f"stage {stage} {extra}: {races[:3]}"
        assert not any(i["skipped"] for i in infos)
        final = dict(opt.full_params())
        if stage < 3:  # the model's own parameters are the published master weights
            for name, p in model.named_parameters():
                assert_bitwise(p.detach(), final[name], f"stage {stage} {extra}: {name} vs master")
        yield stage, extra, final


def check_against_reference(tp, variants):
    from zerotron.parallel import Grid, ParallelDims

    grid = Grid(ParallelDims(tp=tp))
    data = batches(STEPS, MICRO, grid.dp_size)
    truth, _ = reference_train(TinyLM().double(), data)
    torch32, _ = reference_train(TinyLM(), data)
    truth = {n: p.detach() for n, p in truth.named_parameters()}
    torch32 = {n: p.detach() for n, p in torch32.named_parameters()}
    for stage, extra, final in run_variants(grid, tp, variants, "fp64", data):
        for name, value in final.items():
            want = tp_slice(name, truth[reference_name(name)], grid)
            assert_fp64(value, want, FP64_ZERO, f"fp64 stage {stage} {extra}: {name}")
    for stage, extra, final in run_variants(grid, tp, variants, "fp32", data):
        for name, value in final.items():
            ref = reference_name(name)
            assert_fp32(value, tp_slice(name, truth[ref], grid), tp_slice(name, torch32[ref], grid),
                        f"fp32 stage {stage} {extra}: {name}")
    return True


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_stages_equal_adamw_reference(dp):
    variants = VARIANTS if dp != 4 else VARIANTS[:4]  # the other code paths run at DP 1 and 2
    assert all(spawn(check_against_reference, dp, 1, variants, timeout=240))


def test_tp2_dp2_equals_reference():
    assert all(spawn(check_against_reference, 4, 2, VARIANTS[:4], timeout=240))


def _same_arithmetic_reference(data):
    """torch.optim.AdamW (single-tensor kernel) on one rank, accumulating the same micro-batches."""
    model = TinyLM()
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2]},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            foreach=False, **HYPER)
    for mbs in data:
        for x, y in mbs:
            (model(x, y) / len(mbs)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return dict(model.named_parameters())


def check_bitwise(stage, extra):
    from zerotron.parallel import Grid, ParallelDims
    from zerotron.zero import ZeroOptimizer
    from zerotron.zero.adam import FlatAdamW

    grid = Grid(ParallelDims())
    data = batches(STEPS, MICRO, 1)
    want = _same_arithmetic_reference(data)
    model = TinyLM()
    opt = ZeroOptimizer(model, grid, make_cfg(stage, **extra), clip_grad=None, **HYPER)
    opt.adam = FlatAdamW(opt.state.device, prefer_fused=False)  # torch's single-tensor arithmetic
    zero_train(model, opt, data, 0)
    for name, value in opt.full_params():
        assert_bitwise(value, want[name].detach(), f"stage {stage} {extra}: {name}")
    return True


@pytest.mark.parametrize("stage,extra", VARIANTS, ids=[f"{s}-{'-'.join(e) or 'plain'}" for s, e in VARIANTS])
def test_dp1_is_bit_identical_to_torch_doing_the_same_arithmetic(stage, extra):
    assert all(spawn(check_bitwise, 1, stage, extra, timeout=120))


CYCLED_BETAS = [(0.85, 0.99), (0.85, 0.99), (0.95, 0.99), (0.9, 0.99), (0.8, 0.99)]  # OneCycle's per-step betas


def check_cycled_betas():
    """Betas given to ``set_lr`` each step (DeepSpeed's OneCycle) reach the Adam update: torch's
    AdamW with the group's betas changed before every step, bit for bit."""
    from zerotron.parallel import Grid, ParallelDims
    from zerotron.zero import ZeroOptimizer
    from zerotron.zero.adam import FlatAdamW

    data = batches(STEPS, MICRO, 1)
    ref = TinyLM()
    params = list(ref.parameters())
    torch_opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2]},
                                   {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                                  foreach=False, **HYPER)
    for betas, mbs in zip(CYCLED_BETAS, data):
        for group in torch_opt.param_groups:
            group["betas"] = betas
        for x, y in mbs:
            (ref(x, y) / len(mbs)).backward()
        torch_opt.step()
        torch_opt.zero_grad(set_to_none=True)
    model = TinyLM()
    opt = ZeroOptimizer(model, Grid(ParallelDims()), make_cfg(1), clip_grad=None, **HYPER)
    opt.adam = FlatAdamW(opt.state.device, prefer_fused=False)

    def cycle(step, micro, loss):
        if micro == 0:
            opt.set_lr(HYPER["lr"], CYCLED_BETAS[step])
        return loss

    zero_train(model, opt, data, 0, inject=cycle)
    want = dict(ref.named_parameters())
    for name, value in opt.full_params():
        assert_bitwise(value, want[name].detach(), f"cycled betas: {name}")
    return True


def test_cycled_betas_reach_adam():
    assert all(spawn(check_cycled_betas, 1, timeout=120))
