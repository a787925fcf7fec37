"""fp16 dynamic loss scaling across DP ranks, and bf16 training, on 2 gloo ranks (DP 2).

Overflow: rank 1 alone multiplies its loss by inf at step 2. Expected on *every* rank and every
stage: step 2 reports skipped, the parameters do not move, the scale halves (hysteresis 1), and
after ``loss_scale_window`` clean steps the scale doubles again. bf16: a tiny model's loss falls.
"""

import torch

from tests.harness import spawn
from tests.zero.common import HYPER, batches, zero_train
from tests.zero.models import TinyLM


def check_fp16_overflow_skips_everywhere():
    import torch.distributed as dist

    from zerotron.parallel import Grid, ParallelDims
    from zerotron.zero import ZeroConfig, ZeroOptimizer
    from zerotron.zero.loss_scaler import make_loss_scaler

    grid = Grid(ParallelDims())
    rank = dist.get_rank()
    data = batches(6, 2, grid.dp_size)

    def inject(step, micro, loss):
        return loss * float("inf") if (step == 2 and micro == 1 and rank == 1) else loss

    for stage in (0, 1, 2, 3):
        model = TinyLM()
        cfg = ZeroConfig(stage=stage, reduce_bucket_size=500, allgather_bucket_size=500,
                         stage3_param_persistence_threshold=0)
        scaler = make_loss_scaler("fp16", initial_loss_scale=2.0 ** 10, loss_scale_window=2, hysteresis=1,
                                  min_loss_scale=1.0)
        opt = ZeroOptimizer(model, grid, cfg, clip_grad=1.0, precision="fp16", loss_scaler=scaler, **HYPER)
        assert all(p.dtype == torch.float16 for p in model.parameters() if p.numel())
        before = {}
        infos = []
        for step, mbs in enumerate(data):
            if step == 2:
                before = {n: t.clone() for n, t in opt.full_params()}
            infos.extend(zero_train(model, opt, [mbs], grid.dp_rank, inject=lambda s, m, l: inject(step, m, l))[0])
            if step == 2:
                after = dict(opt.full_params())
                assert all(torch.equal(before[n], after[n]) for n in before), f"stage {stage}: skipped step moved params"
        skipped = [i["skipped"] for i in infos]
        scales = [i["loss_scale"] for i in infos]
        assert skipped == [False, False, True, False, False, False], (stage, skipped)
        # window 2: doubles after steps 0-1, halves at the overflow, doubles after 2 clean steps
        assert scales == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0, 2048.0], (stage, scales)
        assert opt.state.step == 5
    return True


def test_fp16_overflow_on_one_rank_skips_on_all_and_halves_scale():
    assert all(spawn(check_fp16_overflow_skips_everywhere, 2, timeout=120))


def check_bf16_loss_falls():
    from zerotron.parallel import Grid, ParallelDims
    from zerotron.zero import ZeroConfig, ZeroOptimizer

    grid = Grid(ParallelDims())
    data = batches(1, 1, grid.dp_size) * 12  # the same batch: the loss must fall
    for stage in (2, 3):
        model = TinyLM()
        opt = ZeroOptimizer(model, grid, ZeroConfig(stage=stage), clip_grad=1.0, precision="bf16", **HYPER)
        assert all(p.dtype == torch.bfloat16 for p in model.parameters() if p.numel())
        assert opt.state.master.dtype == torch.float32 and opt.state.exp_avg.dtype == torch.float32
        infos, losses = zero_train(model, opt, data, grid.dp_rank)
        assert losses[-1] < 0.7 * losses[0], (stage, losses)
        assert not any(i["skipped"] for i in infos) and infos[-1]["loss_scale"] == 1.0
    return True


def test_bf16_trains_tiny_model():
    assert all(spawn(check_bf16_loss_falls, 2, timeout=120))


def check_fp32_master_is_the_parameter():
    from zerotron.parallel import Grid, ParallelDims
    from zerotron.zero import ZeroConfig, ZeroOptimizer, expected_model_state_bytes

    grid = Grid(ParallelDims())
    nd = grid.dp_size
    for stage in (0, 1, 2, 3):
        model = TinyLM()
        cfg = ZeroConfig(stage=stage, reduce_bucket_size=500, allgather_bucket_size=500,
                         stage3_param_persistence_threshold=0)
        opt = ZeroOptimizer(model, grid, cfg, clip_grad=1.0, **HYPER)
        zero_train(model, opt, batches(2, 1, nd), grid.dp_rank)
        mem = opt.memory_report()
        assert mem["master_fp32"] == 0 and opt.state.grad_stage.numel() == 0, (stage, mem)
        store = opt.part_param if stage == 3 else opt.flat_param
        assert all(m.untyped_storage().data_ptr() == store.untyped_storage().data_ptr() for m in opt.masters)
        want = expected_model_state_bytes(opt.num_params, nd, stage, param_bytes=4, k=8)  # K = 8: no master copy
        assert abs(mem["total_model_states"] - want) <= 0.03 * want, (stage, mem, want)
        # the checkpoint view of the scattered master (stages 1-2, several chunks) round-trips
        full = {n: t.clone() for n, t in opt.full_params()}
        state = {k: v.clone() for k, v in opt.partition_state().items() if k in ("master", "exp_avg", "exp_avg_sq")}
        index = opt.partition_index()
        with torch.no_grad():
            for m in opt.masters:
                m.zero_()
        lookup = {(n, s): off for n, s, e, off in index}
        opt.load_partition_state(lambda name, key, start, end: state[key][lookup[(name, start)]:
                                                                         lookup[(name, start)] + end - start])
        assert all(torch.equal(full[n], t) for n, t in opt.full_params()), stage
    return True


def test_fp32_master_weights_are_the_parameters():
    assert all(spawn(check_fp32_master_is_the_parameter, 2, timeout=120))


def test_loss_scale_does_not_cross_precisions():
    from zerotron.zero.loss_scaler import DynamicLossScaler, LossScaler

    fp16 = DynamicLossScaler(1024.0, window=2, hysteresis=1, min_scale=1.0)
    fp16.update(overflow=True)
    bf16 = LossScaler(1.0)
    bf16.load_state_dict(fp16.state_dict())
    assert bf16.scale == 1.0  # bf16 resumed from fp16 keeps its constant scale
    fresh = DynamicLossScaler(1024.0, window=2, hysteresis=1, min_scale=1.0)
    fresh.load_state_dict(LossScaler(1.0).state_dict())
    assert fresh.scale == 1024.0  # fp16 resumed from bf16 starts from its initial scale
    fresh.load_state_dict(fp16.state_dict())
    assert fresh.scale == 512.0
