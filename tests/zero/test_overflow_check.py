"""The fp16 overflow check reads every local gradient, not only those the norm counts (ZeRO §5 + fp16).

The global norm counts a TP-replicated parameter on TP rank 0 only and never the last stage's
tied-embedding copy (``zero.clip.counts_in_norm``), so that nothing is counted twice. The overflow
decision must not inherit that de-duplication: an inf in a gradient the norm skips -- here a
replicated LayerNorm weight and a row-parallel bias on TP rank 1 only -- would otherwise go into
AdamW there, turn that rank's masters into NaN and silently split the TP replicas apart.

Layout: TP 2 x DP 2 (4 gloo ranks), ``TPTinyLM``, fp16 with a dynamic scale (hysteresis 1).
Expected on every rank at every stage: the step with the inf is skipped, the masters and the
parameters are bit-identical before and after it, the scale halves, and the steps before and
after it run normally (the norm, which still de-duplicates, stays finite there).
"""

import torch

from tests.harness import spawn
from tests.zero.common import HYPER, batches, zero_train
from tests.zero.models import TinyLM, TPTinyLM

BAD_STEP = 2


def check_inf_in_uncounted_gradient_skips_everywhere():
    from zerotron.parallel import Grid, ParallelDims
    from zerotron.parallel.shard_info import shard_info
    from zerotron.zero import ZeroConfig, ZeroOptimizer
    from zerotron.zero.loss_scaler import make_loss_scaler

    grid = Grid(ParallelDims(tp=2))
    data = batches(4, 2, grid.dp_size)
    for stage in (0, 1, 2, 3):
        model = TPTinyLM(TinyLM(), grid)
        cfg = ZeroConfig(stage=stage, reduce_bucket_size=400, allgather_bucket_size=400,
                         stage3_param_persistence_threshold=0)
        scaler = make_loss_scaler("fp16", initial_loss_scale=2.0 ** 8, loss_scale_window=100, hysteresis=1)
        opt = ZeroOptimizer(model, grid, cfg, clip_grad=1.0, precision="fp16", loss_scaler=scaler, **HYPER)
        targets = [model.ln_f.weight, model.blocks[0].b2]
        assert all(shard_info(p).replicated for p in targets)  # the norm skips them on TP rank 1
        armed = [False]

        def poison(grad):
            if not armed[0]:
                return None
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
            return grad

        if grid.tp_rank == 1:
            for p in targets:
                p.register_hook(poison)
        infos = []
        for step, mbs in enumerate(data):
            armed[0] = step == BAD_STEP
            if step == BAD_STEP:
                params = {n: t.clone() for n, t in opt.full_params()}
                masters = opt.state.tensors()["master"].clone()
            infos += zero_train(model, opt, [mbs], grid.dp_rank)[0]
            if step == BAD_STEP:
                assert torch.equal(opt.state.tensors()["master"], masters), f"stage {stage}: masters moved"
                assert all(torch.equal(params[n], t) for n, t in opt.full_params()), f"stage {stage}: params moved"
        skipped = [i["skipped"] for i in infos]
        assert skipped == [step == BAD_STEP for step in range(len(data))], (stage, grid.rank, skipped)
        assert [i["loss_scale"] for i in infos] == [256.0, 256.0, 128.0, 128.0], (stage, infos)
        assert all(torch.isfinite(t).all() for _, t in opt.full_params()), stage
    return True


def test_inf_in_a_gradient_the_norm_skips_still_skips_the_step_on_every_rank():
    assert all(spawn(check_inf_in_uncounted_gradient_skips_everywhere, 4, timeout=180))
