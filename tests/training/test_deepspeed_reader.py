"""The DeepSpeed reader without training: bad keys exit 2 naming the key and the closest valid one
(before any process group), the batch triple's arithmetic, precedence, the manual's key table (docs/deepspeed.md), and
the loss scalers the fp16 section asks for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.pretrain_gpt import main
from zerotron.config.cli import parse_config
from zerotron.config.run_config import ConfigError, RunConfig
from zerotron.config.deepspeed import from_deepspeed, markdown_table
from zerotron.config.deepspeed.keys import TOP
from zerotron.config.deepspeed.schema import rows

BAD = [
    ({"zero_optimisation": {"stage": 3}}, "zero_optimisation: not a DeepSpeed key at the top level (did you mean "
                                          "zero_optimization?)"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "bufer_count": 4}}},
     "zero_optimization.offload_param.bufer_count: not a DeepSpeed key in zero_optimization.offload_param (did "
     "you mean buffer_count?)"),
    ({"fp16": {"enabled": True, "initial_scale_pwr": 12}}, "did you mean initial_scale_power?"),
    ({"zero_optimization": 2}, "zero_optimization must be a JSON object of DeepSpeed keys"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled and bf16.enabled are both true"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4},
     "train_batch_size != train_micro_batch_size_per_gpu x gradient_accumulation_steps x dp: 10 != 4 x 1 x 2 = 8"),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
     "32 != 4 x 2 x 2 = 16"),
    ({"gradient_accumulation_steps": 4}, "gradient_accumulation_steps alone does not determine the batch"),
    ({"zero_optimization": {"stage": "auto"}}, "zero_optimization.stage: \"auto\" is not resolvable"),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, "cycle_min_lr is required by OneCycle"),
    ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "warmup_num_steps": 5}}},
     "OneCycle takes no such parameter"),
    ({"scheduler": {"type": "LRRangeTest", "params": {}}}, "scheduler.type='LRRangeTest' is not implemented"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}},
     "total_num_steps is required by WarmupDecayLR"),
    ({"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 10}}}, "WarmupLR takes no such parameter"),
    ({"optimizer": {"type": "Adam", "params": {"lr": 1e-4, "max_grad_norm": 1.0}}}, "top-level gradient_clipping"),
    ({"optimizer": {"type": "Lamb", "params": {}}}, "optimizer.type='Lamb'"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
     "partial optimizer offload is not implemented"),
    ({"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}}, "older spelling"),
    ({"zero_optimization": {"stage3_prefetch_bucket_size": 1e6, "prefetch_bucket_size": 2e6}},
     "same key with different values"),
    ({"data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "bf16", "bf16": {"enabled": True}},
     "give one dtype"),
    ({"amp": {"enabled": True}}, "amp={'enabled': True}: apex AMP is not used"),
    ({"expert_parallel": {"enabled": True}}, "mixture of experts"),
    ({"tensor_parallel": {"autotp_size": 3}}, "parallel.tp*parallel.pp=3*1=3"),
    # a value the run config refuses is named by the JSON key the user wrote
    ({"communication_data_type": "bf16"}, "communication_data_type (read as zero.grad_accum_dtype): "
                                          "zero.grad_accum_dtype='bf16': gradients of fp32 parameters"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}}, "optimizer.params.lr (read as optimizer.lr): "
                                                               "optimizer.min_lr=0.0001 must be between 0 and"),
]


@pytest.mark.parametrize("ds,needle", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_configs_exit_2_naming_the_key(tmp_path, monkeypatch, capsys, ds, needle):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    import torch.distributed as dist

    assert main(["--deepspeed-config", str(path)]) == 2
    assert not dist.is_initialized()  # refused before init_process_group
    err = capsys.readouterr().err
    assert needle in err and f"--deepspeed-config {path}" in err, err


def test_duplicate_key_and_not_json(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"fp16": {"enabled": true}, "fp16": {"enabled": false}}')
    with pytest.raises(ValueError, match="fp16: given twice"):
        parse_config(["--deepspeed-config", str(path)], world_size=1)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        parse_config(["--deepspeed-config", str(path)], world_size=1)


def test_batch_triple_any_two_determine_the_third():
    def batch(ds, world=4, tp=1):
        cfg, _ = from_deepspeed({**ds, "tensor_parallel": {"autotp_size": tp}}, world_size=world)
        return cfg.training.global_batch_size, cfg.training.micro_batch_size, cfg.validate(world).num_microbatches

    assert batch({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}) == (64, 4, 4)
    assert batch({"train_batch_size": 64, "gradient_accumulation_steps": 2}) == (64, 8, 2)
    assert batch({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}) == (48, 4, 3)
    assert batch({"train_batch_size": 64}) == (64, 16, 1)
    assert batch({"train_micro_batch_size_per_gpu": 4}) == (16, 4, 1)
    assert batch({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, tp=2) == (64, 4, 8)  # dp = 2


def test_precedence_yaml_json_flags(tmp_path, capsys):
    yml, ds = tmp_path / "run.yaml", tmp_path / "ds.json"
    yml.write_text("zero: {stage: 1, reduce_bucket_size: 1000}\noptimizer: {lr: 0.5, clip_grad: 3.0}\n")
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 2000},
                              "gradient_clipping": 2.0, "train_micro_batch_size_per_gpu": 2}))
    cfg = parse_config(["--config", str(yml), "--deepspeed-config", str(ds), "--zero-stage", "3"], world_size=2)
    assert cfg.zero.stage == 3  # flag > JSON
    assert cfg.zero.reduce_bucket_size == 2000 and cfg.optimizer.clip_grad == 2.0  # JSON > YAML
    assert cfg.optimizer.lr == 0.5  # YAML where the JSON says nothing
    assert (cfg.training.global_batch_size, cfg.training.micro_batch_size) == (4, 2)
    out = capsys.readouterr().out
    assert "zero_optimization.stage=2 is overridden by the command line: zero.stage=3" in out


def test_auto_with_nothing_else_is_the_run_config():
    cfg, lines = from_deepspeed({"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
                                 "gradient_clipping": "auto", "train_batch_size": "auto",
                                 "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"},
                                world_size=2)
    assert cfg.training.precision == "fp32"
    assert "fp16.enabled: auto -> false (training.precision='fp32')" in lines


def test_every_manual_row_is_the_schema():
    text = (Path(__file__).resolve().parents[2] / "docs" / "deepspeed.md").read_text()
    assert markdown_table(TOP) in text, "docs/deepspeed.md's key table is stale: paste markdown_table(TOP)"
    statuses = {status.split(";")[0] for _, status, _ in rows(TOP)}
    assert statuses == {"honoured", "mapped", "no effect", "refused"}


def test_fp16_scalers():
    from zerotron.zero.loss_scaler import DynamicLossScaler, StaticLossScaler, make_loss_scaler

    static = make_loss_scaler("fp16", loss_scale=1024.0, min_loss_scale=1024.0, initial_loss_scale=1024.0)
    assert isinstance(static, StaticLossScaler) and static.scaled and not static.dynamic
    for overflow in (True, True, False, True):
        static.update(overflow)
    assert static.scale == 1024.0
    plain, consecutive = (DynamicLossScaler(8.0, window=100, hysteresis=2, min_scale=1.0, consecutive_hysteresis=c)
                          for c in (False, True))
    for s in (plain, consecutive):
        for overflow in (True, False, True):  # two overflows with a clean step between them
            s.update(overflow)
    assert (plain.scale, consecutive.scale) == (4.0, 8.0)  # only consecutive ones count with the option
    with pytest.raises(ValueError, match="loss_scale=-1"):
        make_loss_scaler("fp16", loss_scale=-1)


def test_reduce_bucket_size_zero_is_one_parameter_at_a_time():
    from zerotron.zero import ZeroConfig

    z = ZeroConfig(reduce_bucket_size=0).validate()
    assert z.bucket_elements(largest_param=4096) == 4096
    assert ZeroConfig(reduce_bucket_size=0, allgather_bucket_size=1000).bucket_elements(4096) == 1000


def test_one_cycle_without_cycle_momentum_keeps_the_optimizers_betas():
    """DeepSpeed's OneCycle touches the betas only when it cycles momentum."""
    one_cycle = {"cycle_min_lr": 1e-6, "cycle_max_lr": 1e-5, "cycle_first_step_size": 10, "cycle_momentum": False,
                 "cycle_max_mom": 0.5}
    cfg, lines = from_deepspeed({"optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "betas": [0.95, 0.98]}},
                                 "scheduler": {"type": "OneCycle", "params": one_cycle}})
    o = cfg.validate(1).optimizer
    assert (o.schedule, o.beta1, o.beta2, o.cycle_momentum) == ("onecycle", 0.95, 0.98, False)
    assert (o.lr, o.warmup_min_lr, o.warmup_steps) == (1e-5, 1e-6, 10)  # a peak below the default min_lr is fine
    assert any("accepted, no effect here: scheduler.params.cycle_max_mom" in line for line in lines)
    cfg, _ = from_deepspeed({"scheduler": {"type": "OneCycle", "params": {**one_cycle, "cycle_momentum": True}}})
    assert (cfg.optimizer.beta1, cfg.optimizer.beta2, cfg.optimizer.cycle_momentum) == (0.5, 0.99, True)


def test_one_cycle_fields_are_refused_under_another_schedule():
    from zerotron.config.run_config import ConfigError, RunConfig

    cfg = RunConfig()
    cfg.optimizer.decay_lr_rate = 3.0
    with pytest.raises(ConfigError, match="optimizer.decay_lr_rate=3.0 applies to optimizer.schedule=onecycle only"):
        cfg.validate(1)


@pytest.mark.parametrize("scheduler, yaml_optimizer", [
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-5, "cycle_max_lr": 1e-3, "cycle_first_step_size": 5}},
     "{min_lr: 0.0003, decay: linear, schedule_steps: 50}"),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 5}},
     "{schedule: onecycle, warmup_steps: 5, cycle_down_steps: 7, decay_lr_rate: 0.5, decay_step_size: 3}"),
], ids=["yaml-cosine-json-onecycle", "yaml-onecycle-json-warmuplr"])
def test_the_jsons_scheduler_replaces_the_yamls_schedule(tmp_path, scheduler, yaml_optimizer):
    """DeepSpeed reads only its JSON: a YAML's fields of another schedule family must neither be
    ignored silently nor refused -- the JSON's scheduler replaces them."""
    from zerotron.config.run_config import OptimizerSection
    from zerotron.zero.lr_schedule import ONE_CYCLE_FIELDS, OTHER_SCHEDULES_FIELDS

    yml, ds = tmp_path / "run.yaml", tmp_path / "ds.json"
    yml.write_text(f"optimizer: {yaml_optimizer}\n")
    ds.write_text(json.dumps({"scheduler": scheduler}))
    o = parse_config(["--config", str(yml), "--deepspeed-config", str(ds)], world_size=1).optimizer
    replaced = OTHER_SCHEDULES_FIELDS if o.schedule == "onecycle" else ONE_CYCLE_FIELDS
    unset = {n: getattr(OptimizerSection(), n) for n in replaced}
    assert {n: getattr(o, n) for n in replaced} == unset, o


@pytest.mark.parametrize("ds, field, value", [
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 0}}},
     "optimizer.warmup_steps", 0),
    ({"activation_checkpointing": {"partition_activations": False, "number_checkpoints": False}},
     "activation_checkpointing.number_checkpoints", None),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu", "buffer_count": 4}}},
     "zero.offload_param_device", "none"),
], ids=["warmup-0", "number_checkpoints-false", "offload_param-at-stage-2"])
def test_values_deepspeed_accepts_are_accepted(tmp_path, ds, field, value):
    """A warm-up of 0 steps (DeepSpeed clamps it to 2, as our schedule does), a ``false`` count of
    checkpoints (DeepSpeed reads it as unset), both from real configs, and ``offload_param`` below
    stage 3 (DeepSpeed reads it only at stage 3; the start-up lines say it was dropped)."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    cfg = parse_config(["--deepspeed-config", str(path)], world_size=1).validate(1)
    section, name = field.split(".")
    assert getattr(getattr(cfg, section), name) == value


def test_an_auto_value_is_not_blamed_on_the_json(tmp_path):
    """``"lr": "auto"`` takes the run config's lr; an error about it names the run config's field
    alone, not the JSON key that deferred to it."""
    ds, yml = tmp_path / "ds.json", tmp_path / "run.yaml"
    ds.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}))
    yml.write_text("optimizer: {lr: 1.0e-5}\n")  # not a flag: a flag would keep the JSON from applying at all
    with pytest.raises(ConfigError) as err:
        parse_config(["--config", str(yml), "--deepspeed-config", str(ds)], world_size=1).validate(1)
    assert "optimizer.params.lr" not in str(err.value) and "optimizer.min_lr=0.0001" in str(err.value)


def test_stage3_defaults_follow_the_stage_a_flag_sets(tmp_path):
    """A stage-3 JSON fills in DeepSpeed's stage-3 defaults; with ``--zero-stage 2`` on the command
    line they are neither set nor announced (they would do nothing)."""
    from zerotron.config.inert import no_effect

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    cfg = parse_config(["--zero-stage", "2", "--deepspeed-config", str(ds)], world_size=1).validate(1)
    assert cfg.zero.stage3_max_reuse_distance == RunConfig().zero.stage3_max_reuse_distance
    assert no_effect(cfg) == []
    three = parse_config(["--deepspeed-config", str(ds)], world_size=1).validate(1)
    assert three.zero.stage3_max_reuse_distance == 10**9  # DeepSpeed's default, applied at stage 3


def test_a_checkpoint_count_without_the_contiguous_buffer_is_noted_not_refused():
    from zerotron.config.deepspeed import from_deepspeed

    cfg, lines = from_deepspeed({"activation_checkpointing": {"number_checkpoints": 4}})
    assert cfg.validate(1).activation_checkpointing.number_checkpoints is None
    assert any(line.startswith("accepted, no effect here: activation_checkpointing.number_checkpoints")
               for line in lines), lines
