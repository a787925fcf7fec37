"""Config validation fuzzing (issue 10): random run configs, checked the way pretrain_gpt.py does
before ``init_process_group`` (``RunConfig.validate`` + ``setup_run.preflight``).

An independent oracle lists the fields each drawn config gets wrong. Every config the oracle calls
invalid must be rejected with a ``ConfigError`` naming one of those fields (``section.field``);
every config it calls valid must pass and build every pipeline stage of the model on the meta
device (TP rank 0 of a fake grid of the drawn TP/PP sizes) without error.
"""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zerotron.model import GPT, get_preset
from zerotron.model.stages import build_stage
from zerotron.training.config import ConfigError, RunConfig
from zerotron.training.setup_run import model_config, preflight

PRESETS = ("tiny", "megatron-355m", "no-such-preset")


def fake_grid(tp: int, pp: int, pp_rank: int):
    """What GPT's constructor reads from a Grid, for TP rank 0 of pipeline stage ``pp_rank``."""
    return types.SimpleNamespace(tp_size=tp, tp_rank=0, pp_size=pp, pp_rank=pp_rank, dp_size=1, dp_rank=0,
                                 is_first_stage=pp_rank == 0, is_last_stage=pp_rank == pp - 1, rank=0,
                                 tp_group=None, embedding_group=None, world_size=tp * pp)


def pick(draw, valid: list, invalid: list):
    """Mostly a valid value (so that valid configs are common), sometimes an invalid one."""
    if invalid and draw(st.integers(0, 31)) == 0:
        return draw(st.sampled_from(invalid))
    return draw(st.sampled_from(valid))


@st.composite
def configs(draw):
    cfg = RunConfig()
    p, t, z, m, o, ac = cfg.parallel, cfg.training, cfg.zero, cfg.model, cfg.optimizer, cfg.activation_checkpointing
    p.tp = pick(draw, [1, 2, 4], [0, 3])
    p.pp = pick(draw, [1, 1, 2, 3], [0])
    dp = draw(st.sampled_from([1, 2]))
    world = pick(draw, [max(p.tp, 1) * max(p.pp, 1) * dp], [3, 5, 6, 8])
    p.dp = pick(draw, [None, None, dp], [3])
    t.micro_batch_size = pick(draw, [1, 2, 4], [0])
    t.global_batch_size = pick(draw, [t.micro_batch_size * dp * k for k in (1, 2, 3)], [0, 3, 6])
    t.precision = pick(draw, ["fp32", "fp16", "bf16"], ["fp8"])
    z.stage = pick(draw, [0, 1, 2] + ([3] if p.pp == 1 else []), [4, 3])
    z.offload_optimizer = z.stage > 0 and draw(st.booleans()) or pick(draw, [False], [True])
    m.preset = pick(draw, ["tiny", "tiny", "megatron-355m"], ["no-such-preset"])
    m.num_layers = pick(draw, [None, 1, 2, 5], [0])
    m.hidden_size = pick(draw, [None, 64, 96, 128], [0, 100])
    m.num_heads = pick(draw, [None, 2, 4, 8], [0, 3, 6])
    m.seq_length = pick(draw, [None, 16, 64], [0])
    m.dropout = pick(draw, [0.0, 0.1], [1.0, -0.1])
    o.lr = pick(draw, [1e-3], [-1.0])
    o.min_lr = pick(draw, [0.0, 1e-4], [1.0])
    o.initial_loss_scale = pick(draw, [2.0 ** 16, 4.0], [0.0])
    o.min_loss_scale = pick(draw, [1.0], [2.0 ** 20])
    ac.checkpoint_activations = draw(st.booleans())
    for name in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization"):
        setattr(ac, name, pick(draw, [ac.checkpoint_activations and draw(st.booleans())], [True]))
    cfg.logging.log_interval = pick(draw, [1, 10], [0])
    cfg.checkpoint.keep_last = pick(draw, [1, 2], [0])
    return cfg, world


def oracle(cfg: RunConfig, world: int) -> set[str]:
    """The fields ``cfg`` gets wrong on ``world`` processes, worked out independently of the code."""
    bad = set()
    p, t, z, m, o, ac = cfg.parallel, cfg.training, cfg.zero, cfg.model, cfg.optimizer, cfg.activation_checkpointing
    if t.precision not in ("fp32", "fp16", "bf16"):
        bad.add("training.precision")
    if z.stage not in (0, 1, 2, 3):
        bad.add("zero.stage")
    dp = None
    if p.tp < 1:
        bad.add("parallel.tp")
    if p.pp < 1:
        bad.add("parallel.pp")
    if p.tp >= 1 and p.pp >= 1:
        if world % (p.tp * p.pp):
            bad.update({"parallel.tp", "parallel.pp"})
        else:
            dp = world // (p.tp * p.pp)
            if p.dp is not None and p.dp != dp:
                bad.add("parallel.dp")
    for name in ("micro_batch_size", "global_batch_size"):
        if getattr(t, name) < 1:
            bad.add(f"training.{name}")
    if dp and t.micro_batch_size >= 1 and t.global_batch_size >= 1 and t.global_batch_size % (t.micro_batch_size * dp):
        bad.add("training.global_batch_size")
    if p.pp > 1 and z.stage == 3:
        bad.add("zero.stage")
    if z.offload_optimizer and z.stage == 0:
        bad.add("zero.offload_optimizer")
    if o.lr < 0:
        bad.add("optimizer.lr")
    if not 0 <= o.min_lr <= max(o.lr, 0):
        bad.add("optimizer.min_lr")
    if o.initial_loss_scale <= 0:
        bad.add("optimizer.initial_loss_scale")
    if not 0 < o.min_loss_scale <= o.initial_loss_scale:
        bad.add("optimizer.min_loss_scale")
    if not 0 <= m.dropout < 1:
        bad.add("model.dropout")
    if not ac.checkpoint_activations:
        for name in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization"):
            if getattr(ac, name):
                bad.add(f"activation_checkpointing.{name}")
    if cfg.logging.log_interval < 1:
        bad.add("logging.log_interval")
    if cfg.checkpoint.keep_last < 1:
        bad.add("checkpoint.keep_last")
    if m.preset == "no-such-preset":
        bad.add("model.preset")
        return bad
    base = get_preset(m.preset)
    layers = m.num_layers if m.num_layers is not None else base.num_layers
    h = m.hidden_size if m.hidden_size is not None else base.hidden_size
    nh = m.num_heads if m.num_heads is not None else base.num_heads
    seq = m.seq_length if m.seq_length is not None else base.seq_length
    for name, value in (("num_layers", layers), ("hidden_size", h), ("num_heads", nh), ("seq_length", seq)):
        if value < 1:
            bad.add(f"model.{name}")
    if h >= 1 and nh >= 1 and h % nh:
        bad.update({"model.hidden_size", "model.num_heads"})
    if p.tp >= 1 and h >= 1 and nh >= 1 and (h % p.tp or nh % p.tp):
        bad.update({"model.hidden_size", "model.num_heads", "parallel.tp"})
    if p.pp >= 1 and layers >= 1 and p.pp > layers:
        bad.update({"parallel.pp", "model.num_layers"})
    return bad


def names(field: str, msg: str) -> bool:
    """``section.field`` is named, also as in ``section.a/field`` (one message about two fields)."""
    section, name = field.split(".")
    return field in msg or (f"{section}." in msg and name in msg)


def check(cfg: RunConfig, world: int) -> None:
    """What pretrain_gpt.main runs before init_process_group."""
    cfg.validate(world)
    preflight(cfg)


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_invalid_configs_are_rejected_naming_the_field_and_valid_ones_build_on_meta(drawn):
    cfg, world = drawn
    expected = oracle(cfg, world)
    assert not torch.distributed.is_initialized()
    try:
        check(cfg, world)
    except ConfigError as e:
        msg = str(e)
        assert expected, f"valid config rejected (world {world}): {msg}\n{cfg}"
        assert any(names(field, msg) for field in expected), f"message names none of {sorted(expected)}: {msg}"
        return
    assert not expected, f"invalid config accepted (world {world}); wrong fields: {sorted(expected)}\n{cfg}"
    mcfg = model_config(cfg, cfg.data.default_corpus_vocab)
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    for stage in range(pp):
        grid = fake_grid(tp, pp, stage)
        model = (build_stage(mcfg, grid, device="meta") if pp > 1 else GPT(mcfg, grid, device="meta"))
        assert all(q.is_meta for q in model.parameters())
        assert sum(q.numel() for q in model.parameters()) > 0


@pytest.mark.parametrize("flags, field", [
    (["--tp", "3"], "parallel.tp"),
    (["--model.num_heads", "3"], "model.hidden_size"),
    (["--pp", "2", "--zero-stage", "3"], "zero.stage"),
    (["--pp", "4", "--tp", "1", "--model.num_layers", "2", "--global-batch-size", "8"], "parallel.pp"),
    (["--optimizer.min_loss_scale", "1e9", "--precision", "fp16"], "optimizer.min_loss_scale"),
    (["--model.preset", "gpt-5"], "model.preset"),
])
def test_pretrain_gpt_rejects_bad_configs_before_init_process_group(monkeypatch, capsys, flags, field):
    """Through the real entry point, on a 4-process world, with init_distributed booby-trapped."""
    import zerotron.parallel
    from scripts.pretrain_gpt import main

    def trap(*a, **k):
        raise AssertionError("init_distributed reached with an invalid config")

    monkeypatch.setattr(zerotron.parallel, "init_distributed", trap)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    code = main(["--config", "configs/tiny.yaml", "--wandb-mode", "disabled", *flags])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "[rank 3] config error:" in err and field in err, err
