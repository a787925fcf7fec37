"""Config: YAML + DeepSpeed JSON + flags, validated once with errors that name the field."""

import json

import pytest

from zerotron.config.cli import parse_config
from zerotron.config.run_config import ConfigError, RunConfig
from zerotron.zero.lr_schedule import learning_rate


def test_tiny_yaml_and_flags(tmp_path):
    cfg = parse_config(["--config", "configs/tiny.yaml", "--tp", "1", "--zero-stage", "3", "--lr", "1e-3",
                        "--checkpoint-activations", "--partition-activations", "--wandb-mode", "disabled",
                        "--optimizer.beta2", "0.99", "--data.data_weights=0.3,0.7"])
    assert cfg.parallel.tp == 1 and cfg.zero.stage == 3 and cfg.optimizer.lr == 1e-3
    assert cfg.activation_checkpointing.partition_activations is True
    assert cfg.optimizer.beta2 == 0.99 and cfg.data.data_weights == [0.3, 0.7]
    assert cfg.model.seq_length == 128  # from the YAML


def test_deepspeed_json_sections(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e7,
                                                    "offload_optimizer": {"device": "cpu"}},
                              "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True},
                              "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}}))
    cfg = parse_config(["--deepspeed-config", str(ds)])
    assert cfg.zero.grad_accum_dtype == "bf16"
    assert cfg.zero.stage == 2 and cfg.zero.overlap_comm and cfg.zero.reduce_bucket_size == 50_000_000
    assert cfg.zero.offload_optimizer is True and cfg.training.precision == "bf16"
    assert cfg.activation_checkpointing.cpu_checkpointing is True


@pytest.mark.parametrize("argv,world,needle", [
    (["--tp", "3"], 4, "parallel.tp*parallel.pp=3*1=3"),
    (["--zero-stage", "5"], 1, "zero.stage=5"),
    (["--precision", "fp8"], 1, "training.precision='fp8'"),
    (["--global-batch-size", "10", "--micro-batch-size", "4"], 1, "training.global_batch_size=10"),
    (["--training.micro_batch_size", "0"], 1, "training.micro_batch_size=0"),
    (["--lr", "-1"], 1, "optimizer.lr=-1.0"),
    (["--pp", "2", "--zero-stage", "3"], 2, "zero.stage=3 with parallel.pp>1"),
    (["--partition-activations"], 1, "activation_checkpointing.partition_activations"),
    (["--dropout", "1.5"], 1, "model.dropout=1.5"),
    (["--optimizer.schedule", "onecycle", "--optimizer.cycle_momentum", "true", "--optimizer.decay_step_size", "1",
      "--optimizer.decay_beta1_rate", "0.5"], 1, "optimizer.decay_beta1_rate=0.5: OneCycle's beta1 reaches"),
    (["--optimizer.schedule", "onecycle", "--optimizer.decay_step_size", "-1"], 1, "optimizer.decay_step_size=-1"),
    (["--tp", "2", "--sequence-parallel", "--checkpoint-activations",
      "--activation_checkpointing.sequence_parallel_gather", "again"], 2,
     "activation_checkpointing.sequence_parallel_gather='again': use one of ['keep', 'regather']"),
    (["--tp", "2", "--sequence-parallel", "--activation_checkpointing.sequence_parallel_gather", "regather"], 2,
     "sequence_parallel_gather='regather': acts on the recompute of checkpointed chunks"),
    (["--tp", "2", "--checkpoint-activations", "--activation_checkpointing.sequence_parallel_gather", "regather"], 2,
     "sequence_parallel_gather='regather' acts on sequence parallelism's gathers"),
    (["--optimizer.schedule", "onecycle", "--optimizer.min_lr", "0.01"], 1,
     "optimizer.min_lr=0.01 has no effect under optimizer.schedule=onecycle (its floor is optimizer.warmup_min_lr)"),
    (["--optimizer.schedule", "onecycle", "--optimizer.decay", "linear"], 1, "optimizer.decay='linear' has no effect"),
    (["--optimizer.schedule", "onecycle", "--optimizer.schedule_steps", "100"], 1,
     "optimizer.schedule_steps=100 has no effect"),
])
def test_invalid_values_name_the_field(argv, world, needle):
    with pytest.raises(ConfigError) as info:
        parse_config(argv).validate(world)
    assert needle in str(info.value)


@pytest.mark.parametrize("argv,needle", [
    (["--model.hidden", "3"], "unknown config key model.hidden"),
    (["--modle.hidden_size", "3"], "unknown config section 'modle'"),
    (["--tp", "two"], "parallel.tp='two' is not a valid int"),
    (["--config", "/nonexistent.yaml"], "file not found"),
    (["--bogus"], "unknown argument '--bogus'"),
    (["--tp", "4", "--parallel.tp", "2"], "--tp and --parallel.tp both set parallel.tp; give one of them"),
    (["--parallel.tp=2", "--tp", "4"], "--tp and --parallel.tp both set parallel.tp"),
    (["--train-steps", "5", "--training.train-steps", "6"], "--train-steps and --training.train-steps both set"),
    (["--lr", "0.5", "--lr", "0.001"], "--lr is given twice (--lr 0.5, then --lr 0.001)"),
    (["--model.hidden_size=8", "--model.hidden_size", "16"], "--model.hidden_size is given twice"),
    (["--model.hidden-size", "8", "--model.hidden_size", "16"],
     "--model.hidden-size and --model.hidden_size"),
    (["--checkpoint-activations"] * 2, "--checkpoint-activations is given twice"),
])
def test_bad_keys_and_types(argv, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        parse_config(argv)


def test_unknown_yaml_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("zero:\n  stag: 2\n")
    with pytest.raises(ConfigError, match="unknown config key zero.stag"):
        parse_config(["--config", str(bad)])


def test_dp_inferred_and_microbatches():
    cfg = RunConfig()
    cfg.parallel.tp, cfg.training.micro_batch_size, cfg.training.global_batch_size = 2, 4, 32
    cfg.validate(8)
    assert cfg.parallel.dp == 4 and cfg.num_microbatches == 2


def test_schedule_warmup_then_cosine_to_min():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=110)
    assert learning_rate(0, decay="cosine", **kw) == pytest.approx(0.1)
    assert learning_rate(9, decay="cosine", **kw) == pytest.approx(1.0)
    assert learning_rate(60, decay="cosine", **kw) == pytest.approx(0.55)
    assert learning_rate(110, decay="cosine", **kw) == pytest.approx(0.1)
    assert learning_rate(60, decay="linear", **kw) == pytest.approx(0.55)
    assert learning_rate(500, decay="constant", **kw) == 1.0


def test_schedule_field_defaults_are_the_sections():
    """The schedule checks compare against the section's own defaults: a section left at its
    defaults is accepted under every schedule, and each checked field's default is the section's."""
    import dataclasses

    from zerotron.config.run_config import OptimizerSection
    from zerotron.zero.lr_schedule import (ONE_CYCLE_FIELDS, OTHER_SCHEDULES_FIELDS, SCHEDULES, check_schedule,
                                            field_default)

    section = OptimizerSection()
    for name in (*ONE_CYCLE_FIELDS, *OTHER_SCHEDULES_FIELDS):
        assert field_default(section, name) == getattr(section, name), name
    for schedule in SCHEDULES:
        check_schedule(dataclasses.replace(section, schedule=schedule))
