"""Config validation fuzzing: random run configs, checked the way pretrain_gpt.py does before
``init_process_group`` (``RunConfig.validate`` + ``setup_run.preflight``).

No second copy of the rules decides what is valid; the properties are the contract itself:

* a refused config is refused with a ``ValueError`` (``ConfigError``) or ``SystemExit`` -- never
  another exception -- whose message names at least one real ``section.field`` of the run config;
* an accepted config builds: every pipeline stage of its model on the meta device, for any size;
  and, for the layouts a 2-core machine can host (at most 4 ranks, the tiny preset), a grid of
  gloo ranks that runs a training step with the same finite loss on every rank.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.harness import spawn
from zerotron.model import GPT
from zerotron.model.stages import build_stage
from zerotron.config.run_config import RunConfig
from zerotron.training.setup_run import model_config, preflight

CONFIG_FIELDS = {f"{section.name}.{f.name}" for section in dataclasses.fields(RunConfig)
                 for f in dataclasses.fields(getattr(RunConfig(), section.name))}
NAMED = re.compile(r"\b([a-z_]+\.[a-z_0-9]+)")


def fake_grid(tp: int, pp: int, pp_rank: int):
    """What GPT's constructor reads from a Grid, for TP rank 0 of pipeline stage ``pp_rank``."""
    return types.SimpleNamespace(tp_size=tp, tp_rank=0, pp_size=pp, pp_rank=pp_rank, dp_size=1, dp_rank=0,
                                 cp_size=1, cp_rank=0,
                                 is_first_stage=pp_rank == 0, is_last_stage=pp_rank == pp - 1, rank=0,
                                 tp_group=None, embedding_group=None, world_size=tp * pp)


def pick(draw, valid: list, invalid: list, invalid_odds: int):
    """Mostly a valid value (so accepted configs are common), 1 in ``invalid_odds`` an invalid one."""
    if invalid and invalid_odds and draw(st.integers(0, invalid_odds - 1)) == 0:
        return draw(st.sampled_from(invalid))
    return draw(st.sampled_from(valid))


@st.composite
def configs(draw, small: bool = False):
    """``(config, world size)``. ``small``: only values that are valid field by field, the tiny
    preset and at most 4 ranks (combinations can still be invalid)."""
    odds = 0 if small else 32

    def one(valid, invalid=()):
        return pick(draw, valid, list(invalid), odds)

    cfg = RunConfig()
    p, t, z, m, o, ac = cfg.parallel, cfg.training, cfg.zero, cfg.model, cfg.optimizer, cfg.activation_checkpointing
    layouts = [(tp, pp, dp) for tp in (1, 2, 4) for pp in (1, 1, 2, 3) for dp in (1, 2)]
    p.tp, p.pp, dp = draw(st.sampled_from([x for x in layouts if not small or x[0] * x[1] * x[2] <= 4]))
    p.tp, p.pp = one([p.tp], [0, 3]), one([p.pp], [0])
    world = one([max(p.tp, 1) * max(p.pp, 1) * dp], [3, 5, 6, 8])
    p.dp = one([None, None, dp], [3])
    t.micro_batch_size = one([1, 2, 4], [0])
    t.global_batch_size = one([t.micro_batch_size * dp * k for k in (1, 2, 3)], [0, 3, 6])
    t.precision = one(["fp32", "fp16", "bf16", "fp64"], ["fp8"])
    z.stage = one([0, 1, 2] + ([3] if p.pp == 1 else []), [4, 3])
    z.offload_optimizer = z.stage > 0 and draw(st.booleans()) or one([False], [True])
    m.preset = one(["tiny"] if small else ["tiny", "tiny", "megatron-355m"], ["no-such-preset"])
    m.num_layers = one([None, 1, 2, 5], [0])
    m.hidden_size = one([None, 64, 96, 128], [0, 100])
    m.num_heads = one([None, 2, 4, 8], [0, 3, 6])
    m.seq_length = one([None, 16, 64], [0])
    m.dropout = one([0.0, 0.1], [1.0, -0.1])
    o.lr = one([1e-3], [-1.0])
    o.min_lr = one([0.0, 1e-4], [1.0])
    o.initial_loss_scale = one([2.0 ** 16, 4.0], [0.0])
    o.min_loss_scale = one([1.0], [2.0 ** 20])
    ac.checkpoint_activations = draw(st.booleans())
    for name in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization"):
        setattr(ac, name, one([ac.checkpoint_activations and draw(st.booleans())], [True]))
    cfg.logging.log_interval = one([1, 10], [0])
    cfg.checkpoint.keep_last = one([1, 2], [0])
    return cfg, world


def check(cfg: RunConfig, world: int) -> str | None:
    """What pretrain_gpt.main runs before init_process_group: None if accepted, else the message."""
    try:
        cfg.validate(world)
        preflight(cfg)
    except (ValueError, SystemExit) as e:
        return str(e)
    return None


def assert_names_a_field(msg: str, cfg: RunConfig) -> None:
    named = set(NAMED.findall(msg)) & CONFIG_FIELDS
    assert named, f"the refusal names no section.field of the run config: {msg!r}\n{cfg}"


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_refusals_name_a_field_and_acceptances_build_every_stage_on_meta(drawn):
    cfg, world = drawn
    assert not torch.distributed.is_initialized()
    msg = check(cfg, world)
    if msg is not None:
        assert_names_a_field(msg, cfg)
        return
    mcfg = model_config(cfg, cfg.data.default_corpus_vocab)
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    for stage in range(pp):
        grid = fake_grid(tp, pp, stage)
        model = (build_stage(mcfg, grid, device="meta") if pp > 1 else GPT(mcfg, grid, device="meta"))
        assert all(q.is_meta for q in model.parameters())
        assert sum(q.numel() for q in model.parameters()) > 0


def one_step(cfg: RunConfig) -> float:
    """Build the grid and the Trainer of ``cfg`` on this rank and run one training step."""
    import torch.distributed as dist

    from zerotron.parallel.runtime import init_distributed
    from zerotron.training.build_run import build_run
    from zerotron.training.trainer import Trainer

    cfg.validate(dist.get_world_size())
    trainer = Trainer(build_run(cfg, init_distributed()))
    loss = float(trainer.train_step()["loss"])
    trainer.grid.close()
    return loss


@settings(max_examples=4, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(drawn=configs(small=True))
def test_accepted_small_configs_run_a_training_step(drawn, zerotron_cache, tmp_path_factory):
    cfg, world = drawn
    msg = check(cfg, world)
    if msg is not None:
        assert_names_a_field(msg, cfg)
    assume(msg is None)
    run_dir = tmp_path_factory.mktemp("run")
    cfg.data.cache_dir, cfg.logging.run_dir, cfg.logging.wandb_mode = zerotron_cache, str(run_dir), "disabled"
    cfg.training.train_steps, cfg.logging.eval_interval, cfg.checkpoint.save = 1, 0, None
    losses = spawn(one_step, world, cfg, timeout=120)
    assert all(math.isfinite(x) for x in losses) and len(set(losses)) == 1, (losses, cfg)


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
