"""``ShardInfo``: every parameter must carry one, and what it says decides the gradient norm.

A parameter without one must fail loudly instead of counting as replicated, which would drop a
split weight's other TP slices from the norm and scramble a resharded checkpoint.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from zerotron.parallel.shard_info import ShardInfo, ShardInfoError, mark_replicated, set_shard_info, shard_info
from zerotron.zero.clip import counts_in_norm


def test_missing_shard_info_is_an_error_naming_the_parameter_and_the_fix():
    p = nn.Parameter(torch.zeros(3, 5))
    with pytest.raises(ShardInfoError) as e:
        shard_info(p, "blocks.0.fc.weight")
    msg = str(e.value)
    assert "'blocks.0.fc.weight'" in msg and "(3, 5)" in msg
    assert "TP layers" in msg and "set_shard_info" in msg and "mark_replicated" in msg
    with pytest.raises(ShardInfoError):
        counts_in_norm(p, tp_rank=0)  # the gradient norm has no default either


def test_mark_replicated_fills_only_the_missing_and_survives_dtype_and_data_rebinding():
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6))
    split = model[0].weight
    set_shard_info(split, ShardInfo.from_local(split.shape, 0, tp_size=2))
    assert mark_replicated(model) is model
    assert shard_info(split) == ShardInfo(0, (12, 4))
    assert shard_info(model[0].bias) == ShardInfo(None, (6,))
    model.double()
    split.data = torch.empty(0, dtype=torch.float64)  # as ZeRO stage 3 releases a parameter
    assert shard_info(split).tp_split_dim == 0 and shard_info(model[1].weight).replicated


def test_shard_info_must_fit_the_parameter():
    p = nn.Parameter(torch.zeros(4, 6))
    for bad in (ShardInfo(None, (8, 6)), ShardInfo(0, (9, 6)), ShardInfo(1, (8, 12)), ShardInfo(0, (4,))):
        with pytest.raises(ShardInfoError, match="does not fit"):
            set_shard_info(p, bad)
    with pytest.raises(ShardInfoError, match="not a dimension"):
        ShardInfo(2, (4, 6))
    with pytest.raises(ShardInfoError, match="TP size"):
        ShardInfo(0, (6, 4)).local_shape(4)
    info = ShardInfo.from_local((4, 6), 1, tp_size=4)
    assert info.global_shape == (4, 24) and info.local_shape(4) == (4, 6) and info.local_shape(1) == (4, 24)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.tp_split_dim = None


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_norm_counts_split_slices_everywhere_replicated_once_embedding_copy_never(tp_rank):
    def param(info):
        return set_shard_info(nn.Parameter(torch.zeros(info.local_shape(2))), info)

    assert counts_in_norm(param(ShardInfo(0, (8, 4))), tp_rank)
    assert counts_in_norm(param(ShardInfo(None, (4,))), tp_rank) == (tp_rank == 0)
    assert not counts_in_norm(param(ShardInfo(0, (8, 4), embedding_copy=True)), tp_rank)
