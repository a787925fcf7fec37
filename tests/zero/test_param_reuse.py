"""A parameter whose gradient arrives more than once in one backward, at every ZeRO stage, DP 2.

A module applied twice inside one autograd graph gets one summed gradient (autograd's
``AccumulateGrad`` runs once); but under *reentrant* activation checkpointing -- torch's
``use_reentrant=True`` and zerotron's own ``activation.checkpoint`` recompute every segment in a
backward of its own -- a module used in two segments receives two gradients, and its
post-accumulate hook fires twice. The bucket reducer (ZeRO §5.2, CB §6.2) must then neither
reduce a bucket before the second gradient is in (the first step) nor drop a gradient that
arrives after its bucket went out; from the second step on it waits for both.

``Reuse``: an embedding, one root-level ``Linear`` applied twice (each application a reentrant
checkpoint; once, plainly, in the stage-3 variant), a block -- a stage-3 unit -- applied twice
(reentrant), the same block once more without checkpointing, and a head. Tier
``tests/parity.py`` float64: 3 steps of 2 micro-batches against torch AdamW on the full batch,
within ``FP64_ZERO``; a dropped or early-reduced gradient moves a parameter by ~4e-2. With
``overlap_comm`` a late arrival must also not be accumulated (even as zeros) into a bucket whose
collective is still in flight: ``tests/zero/inflight_guard.py`` watches every write.

Stage 3 releases a unit's parameters once each has a gradient (``zero.stage3``), so there a
module reused across reentrant segments has to be a unit of its own (the block, not the root's
Linear): the root-level reuse runs at stages 0-2.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.harness import spawn
from tests.parity import FP64_ZERO, assert_fp64
from tests.zero.inflight_guard import no_writes_into_inflight_collectives
from tests.zero.common import HYPER, SEQ, VOCAB, batches, reference_train, zero_train

STEPS, MICRO = 3, 2


class Reuse(nn.Module):
    def __init__(self, root_reuse: bool, d: int = 16):
        from zerotron.parallel.shard_info import mark_replicated

        super().__init__()
        torch.manual_seed(0)
        self.root_reuse = root_reuse
        self.embed = nn.Embedding(VOCAB, d)
        self.shared = nn.Linear(d, d)
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d))])
        self.head = nn.Linear(d, VOCAB)
        mark_replicated(self)

    def _shared(self, h):
        return torch.tanh(self.shared(h))

    def forward(self, x, labels):
        h = self.embed(x)
        for _ in range(2 if self.root_reuse else 1):
            h = h + (checkpoint(self._shared, h, use_reentrant=True) if self.root_reuse else self._shared(h))
        block = self.blocks[0]
        for _ in range(2):
            h = h + checkpoint(block, h, use_reentrant=True)
        h = h + block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def check_reuse(root_reuse: bool, stages):
    from zerotron.parallel import Grid, ParallelDims
    from zerotron.zero import ZeroConfig, ZeroOptimizer

    grid = Grid(ParallelDims())
    data = batches(STEPS, MICRO, grid.dp_size)
    truth = dict(reference_train(Reuse(root_reuse).double(), data)[0].named_parameters())
    for stage in stages:
        for extra in ({}, {"overlap_comm": True}, {"contiguous_gradients": False, "overlap_comm": True}):
            model = Reuse(root_reuse).double()
            cfg = ZeroConfig(stage=stage, reduce_bucket_size=300, allgather_bucket_size=300,
                             stage3_param_persistence_threshold=0, **extra)
            opt = ZeroOptimizer(model, grid, cfg, clip_grad=1.0, precision="fp64", **HYPER)
            with no_writes_into_inflight_collectives() as races:
                infos, _ = zero_train(model, opt, data, grid.dp_rank)
            assert not races, f"stage {stage} {extra}: {races[:3]}"
            assert not any(i["skipped"] for i in infos)
            for name, value in opt.full_params():
                assert_fp64(value, truth[name].detach(), FP64_ZERO, f"stage {stage} {extra}: {name}")
    return True


@pytest.mark.parametrize("root_reuse,stages", [(True, (0, 1, 2)), (False, (0, 1, 2, 3))],
                         ids=["root-linear-stages0-2", "unit-block-stages0-3"])
def test_gradient_arriving_twice_in_one_backward_equals_torch(root_reuse, stages):
    assert SEQ == 8
    assert all(spawn(check_reuse, 2, root_reuse, stages, timeout=180))
