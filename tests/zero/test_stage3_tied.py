"""Stage 3 with a parameter registered on two modules that sit in different gather units.

Pos+g+p (ZeRO §5.3) gathers a unit's layout group around the unit's forward and backward. A tied
parameter used by the root *and* by a block (``blocks[1].ln.weight = ln_f.weight``) must be
gathered while either runs: were it owned by the block alone, the root's ``ln_f`` would run on
the empty tensor the block's release leaves. A weight tied between two blocks is the same case
one level down. Tier ``tests/parity.py`` float64: 3 steps of 2 micro-batches at DP 2 against
torch AdamW on the full batch, within ``FP64_ZERO``.
"""

import pytest
import torch

from tests.harness import spawn
from tests.parity import FP64_ZERO, assert_fp64
from tests.zero.common import HYPER, batches, reference_train, zero_train
from tests.zero.models import TinyLM

STEPS, MICRO = 3, 2


def _tied(kind: str) -> TinyLM:
    model = TinyLM().double()
    if kind == "root-and-block":
        model.blocks[1].ln.weight = model.ln_f.weight
    else:
        model.blocks[1].fc1.weight = model.blocks[0].fc1.weight
    return model


def test_tied_parameter_belongs_to_every_unit_that_registers_it():
    from zerotron.zero.stage3 import default_units, unit_params

    model = _tied("root-and-block")
    params = list(model.parameters())
    per_unit = unit_params(default_units(model), params)
    tied = next(i for i, p in enumerate(params) if p is model.ln_f.weight)
    assert tied in per_unit[0] and tied in per_unit[2] and tied not in per_unit[1]


def check_tied(kind: str):
    from zerotron.parallel import Grid, ParallelDims
    from zerotron.zero import ZeroConfig, ZeroOptimizer

    grid = Grid(ParallelDims())
    data = batches(STEPS, MICRO, grid.dp_size)
    truth = dict(reference_train(_tied(kind), data)[0].named_parameters())
    for extra in ({}, {"overlap_comm": True}):
        model = _tied(kind)
        cfg = ZeroConfig(stage=3, reduce_bucket_size=300, allgather_bucket_size=300,
                         stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=2000, **extra)
        opt = ZeroOptimizer(model, grid, cfg, clip_grad=1.0, precision="fp64", **HYPER)
        infos, _ = zero_train(model, opt, data, grid.dp_rank)
        assert not any(i["skipped"] for i in infos)
        for name, value in opt.full_params():
            assert_fp64(value, truth[name].detach(), FP64_ZERO, f"{kind} {extra}: {name}")
        with torch.no_grad():
            model(*data[0][0])  # an inference forward gathers and releases the tied group too
        assert all(p.numel() == 0 for p in model.parameters()), f"{kind}: left gathered after no_grad"
    return True


@pytest.mark.parametrize("kind", ["root-and-block", "block-and-block"])
def test_stage3_tied_across_units_equals_torch(kind):
    assert all(spawn(check_tied, 2, kind, timeout=180))
