"""Single-process pieces: ZeroConfig validation and DeepSpeed keys, the loss scaler, the flat layout."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zerotron.zero import DynamicLossScaler, ZeroConfig
from zerotron.config.deepspeed import from_deepspeed
from zerotron.zero.loss_scaler import make_loss_scaler
from zerotron.zero.partition import Layout


@pytest.mark.parametrize("key,value", [
    ("stage", 4), ("reduce_bucket_size", -1), ("allgather_bucket_size", -5), ("stage3_prefetch_bucket_size", -1),
    ("stage3_param_persistence_threshold", -1), ("overlap_comm", "yes"), ("sub_group_size", -1),
    ("zero_hpz_partition_size", -1),
])
def test_validation_names_the_key(key, value):
    with pytest.raises(ValueError, match=f"zero.{key}="):
        ZeroConfig(**{key: value}).validate()


def test_zero_sizes_deepspeed_bounds_at_0_take_0():
    """DeepSpeed declares these ``ge=0``: 0 prefetches nothing, makes each sub-group one parameter,
    and leaves hpZ off (its secondary group is made only for a size > 1)."""
    cfg = ZeroConfig(stage=3, stage3_prefetch_bucket_size=0, sub_group_size=0, zero_hpz_partition_size=0).validate(4)
    assert cfg.optimizer_tile(largest_param=4097, dp=4) == 1025  # the largest parameter's share
    assert ZeroConfig(sub_group_size=1000).optimizer_tile(largest_param=4097, dp=4) == 1000


def test_stage3_prefetch_0_gathers_and_reads_nothing_ahead():
    from types import SimpleNamespace

    from zerotron.zero.stage3 import ParamGatherer

    calls = []
    g = ParamGatherer.__new__(ParamGatherer)  # the prefetch walk alone, over three units of 10 elements
    g.layout = SimpleNamespace(groups=[SimpleNamespace(numel=10, persistent=False) for _ in range(3)])
    g.order, g.unit_groups, g.full, g.recording, g.max_live_numel = [0, 1, 2], [[0], [1], [2]], {}, False, 10**9
    g.refs, g.bwd_active = [0] * 3, [False] * 3
    g.source = SimpleNamespace(read_ahead=lambda groups: calls.append(("read", groups)))
    g._gather = lambda i, async_op: calls.append(("gather", i))
    for budget, want in ((15, [("gather", 1), ("read", [2])]), (0, [])):
        calls.clear()
        g.prefetch_numel = budget
        g._prefetch(0, +1)
        assert calls == want, budget


@pytest.mark.parametrize("key,value", [("hysteresis", 0), ("min_loss_scale", 0.0), ("loss_scale_window", 1.5)])
def test_loss_scaling_validation_names_the_key(key, value):
    with pytest.raises(ValueError, match=f"{key}="):
        make_loss_scaler("fp16", **{key: value})


def test_precision_is_checked_against_the_config():
    with pytest.raises(ValueError, match="precision='fp8'"):
        ZeroConfig().validate(precision="fp8")
    with pytest.raises(ValueError, match="zero.zero_quantized_weights=True"):
        ZeroConfig(stage=3, zero_quantized_weights=True).validate(precision="fp64")


def test_offload_needs_a_partitioned_stage():
    with pytest.raises(ValueError, match="offload_optimizer"):
        ZeroConfig(stage=0, offload_optimizer=True).validate()


def zero_from_deepspeed(ds: dict) -> ZeroConfig:
    """The ZeroConfig the one DeepSpeed reader (``config.deepspeed``) makes of a whole DeepSpeed config."""
    return from_deepspeed(ds)[0].zero.validate()


def test_from_deepspeed_maps_keys():
    ds = {"zero_optimization": {"stage": 3, "contiguous_gradients": True, "reduce_bucket_size": 5e7,
                                "allgather_bucket_size": 2e8, "stage3_prefetch_bucket_size": 1e7,
                                "stage3_param_persistence_threshold": 1e4, "offload_optimizer": {"device": "cpu"},
                                "reduce_scatter": True},
          "fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 3,
                   "min_loss_scale": 2}}
    run, _ = from_deepspeed(ds)
    cfg = run.zero.validate()
    assert (cfg.stage, cfg.overlap_comm, cfg.offload_optimizer) == (3, True, True)  # DeepSpeed: overlap at stage 3
    assert (cfg.reduce_bucket_size, cfg.allgather_bucket_size, cfg.stage3_prefetch_bucket_size) == (50_000_000, 200_000_000, 10_000_000)
    assert cfg.stage3_param_persistence_threshold == 10_000
    o = run.optimizer
    assert run.training.precision == "fp16"
    assert (o.initial_loss_scale, o.loss_scale_window, o.hysteresis, o.min_loss_scale) == (4096.0, 500, 3, 2.0)
    assert zero_from_deepspeed({"zero_optimization": {"stage": 1}}).overlap_comm is False
    assert from_deepspeed({"bf16": {"enabled": True}, "fp16": {"enabled": False}})[0].training.precision == "bf16"
    with pytest.raises(ValueError, match="enable one of them"):
        from_deepspeed({"bf16": {"enabled": True}, "fp16": {"enabled": True}})


@pytest.mark.parametrize("zero,match", [
    ({"stage": 2, "round_robin_gradient": True}, "zero_optimization.round_robin_gradient: .*did you mean "
                                                 "round_robin_gradients"),
    ({"stage": 5}, "zero.stage=5"),
    ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}, "offload_optimizer_device"),
    ({"stage": 2, "mics_shard_size": 4}, "zero_optimization.mics_shard_size=4: MiCS"),
    ({"stage": 2, "reduce_bucket_size": "big"}, "zero_optimization.reduce_bucket_size='big'"),
])
def test_from_deepspeed_errors_name_the_key(zero, match):
    with pytest.raises(ValueError, match=match):
        zero_from_deepspeed({"zero_optimization": zero})


def test_dynamic_loss_scaler_hysteresis_window_and_minimum():
    s = DynamicLossScaler(8.0, window=3, hysteresis=2, min_scale=2.0)
    s.update(True)
    assert s.scale == 8.0  # first overflow spends hysteresis
    s.update(True)
    assert s.scale == 4.0
    s.update(True)
    assert s.scale == 2.0
    s.update(True)
    assert s.scale == 2.0  # never below the minimum
    for _ in range(3):
        s.update(False)
    assert s.scale == 4.0 and s.hysteresis_left == 2
    t = DynamicLossScaler(1.0, 1, 1, 1.0)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=6), shards=st.integers(1, 4),
       chunk=st.integers(4, 50), split=st.integers(0, 6))
def test_every_element_is_owned_by_exactly_one_rank(sizes, shards, chunk, split):
    shapes = [torch.Size([n]) for n in sizes]
    split = min(split, len(sizes))
    groups = [g for g in (list(range(split)), list(range(split, len(sizes)))) if g]
    seen = {(p, i): 0 for p, n in enumerate(sizes) for i in range(n)}
    part = None
    for r in range(shards):
        lay = Layout(shapes, groups, shards, r, chunk)
        assert part in (None, lay.part_numel)  # every rank holds the same (padded) size
        part = lay.part_numel
        assert all(c.numel <= max(chunk - chunk % shards, shards) and c.numel % shards == 0 for c in lay.chunks)
        for name, s, e, off in lay.partition_index([str(i) for i in range(len(sizes))]):
            assert 0 <= off and off + e - s <= lay.part_numel
            for i in range(s, e):
                seen[(int(name), i)] += 1
    assert set(seen.values()) == {1}
