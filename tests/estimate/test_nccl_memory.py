"""NCCL communicator memory (issue 41, item 9): the groups the model charges are those a real
``Grid`` builds.

The reference is torch itself: a ``Grid`` is built on the ``fake`` backend for one rank of the
world, every ``torch.distributed.new_group`` call is recorded, and the distinct rank tuples that
hold this rank (plus the default group) are the communicators it would own under NCCL. ZeRO++'s
node-local groups come from the real ``zeropp.groups.node_groups`` path. The model's own count
(``nccl_memory.member_group_sizes``) is pure arithmetic and must agree, group size by group size.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from zerotron.estimate import nccl_memory
from zerotron.estimate.memory_model import Setup, estimate
from zerotron.model import GPTConfig
from zerotron.parallel import Grid, ParallelDims, host_sync, simulation
from zerotron.zero.zeropp.groups import node_groups

LAYOUTS = [  # tp, cp, dp, pp, hpz, qgz
    (2, 1, 2, 2, 1, 1), (1, 1, 2, 4, 1, 1), (2, 2, 2, 1, 1, 1), (2, 2, 1, 2, 1, 1),
    (1, 1, 4, 1, 1, 1), (1, 1, 1, 2, 1, 1), (4, 1, 1, 1, 1, 1), (2, 1, 8, 1, 4, 2),
    (1, 1, 8, 2, 2, 2), (2, 1, 4, 3, 2, 1),
]


def communicators_built(monkeypatch, rank: int, tp: int, cp: int, dp: int, pp: int, hpz: int,
                        qgz: int):
    """Sizes of the distinct groups holding ``rank`` that a real ``Grid`` (and ZeRO++'s split)
    creates."""
    made = []
    real = dist.new_group

    def recording(ranks, *a, **k):  # the real call, its ranks noted
        made.append(tuple(ranks))
        return real(ranks, *a, **k)

    monkeypatch.setattr(dist, "new_group", recording)
    world = tp * cp * dp * pp
    with simulation.fake_world(rank, world, device_type="cpu"), host_sync.simulate():  # a dry run's
        grid = Grid(ParallelDims(tp=tp, cp=cp, pp=pp))
        try:
            node_groups(grid, hpz)  # what zero.strategy_choice.build creates for hpZ, then qgZ
            node_groups(grid, qgz)
        finally:
            grid.close()
    mine = {g for g in made if rank in g and len(g) > 1}
    return sorted(len(g) for g in mine) + ([world] if world > 1 else [])  # + the default group


@pytest.mark.parametrize("tp,cp,dp,pp,hpz,qgz", LAYOUTS)
def test_the_model_charges_the_communicators_a_real_grid_builds(monkeypatch, tp, cp, dp, pp, hpz,
                                                                qgz):
    world = tp * cp * dp * pp
    for rank in sorted({0, world - 1, world // 2}):  # first, middle and last stage
        built = communicators_built(monkeypatch, rank, tp, cp, dp, pp, hpz, qgz)
        stage = rank // (tp * cp * dp)
        model = nccl_memory.member_group_sizes(tp, cp, dp, pp, stage, hpz, qgz)
        assert sorted(model.values()) == built, (rank, model, built)


def test_a_group_costs_what_nccl_users_measured():
    """NVIDIA/nccl#964: 688 MB per group of more than 2 ranks on 4 NVLink A100s, at NCCL's
    defaults. The model's ring + tree buffers on its 24 channels come within 2 %."""
    assert abs(nccl_memory.collective_bytes(4) / 688e6 - 1) < 0.02


def test_the_line_is_device_only_and_outside_the_allocators_figure():
    model = GPTConfig(num_layers=2, hidden_size=64, num_heads=4, vocab_size=512, seq_length=32)
    gpu = Setup(model, tp=2, dp=4, pp=2)
    e = estimate(gpu)
    groups = nccl_memory.member_group_sizes(2, 1, 4, 2)  # tp, dp, pp, mp, world
    expected = (sum(nccl_memory.collective_bytes(n) for n in groups.values())
                + nccl_memory.p2p_bytes(2, 0))
    assert e["nccl_communicators"] == expected > 0
    assert e["total"] == pytest.approx(e["before_margin"] / (1 - gpu.margin) + expected)
    for cpu_run in (dataclasses.replace(gpu, backend="gloo"),
                    dataclasses.replace(gpu, device="cpu")):
        assert estimate(cpu_run)["nccl_communicators"] == 0
