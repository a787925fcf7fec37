"""Settings that do nothing in their run are accepted and said at start-up (``config.inert``):
each rule names a real field, a value away from the default is noted exactly when its feature is
off, a default value is never noted, and the note reaches the user from the YAML/flags and from a
DeepSpeed JSON alike."""

from __future__ import annotations

import json

import pytest

from zerotron.config.cli import last_wins, parse_config
from zerotron.config.run_config import RunConfig
from zerotron.config.inert import RULES, no_effect

CASES = [  # (field, flags that set it with its feature off, flags that turn the feature on)
    ("zero.stage3_max_live_parameters", ["--zero.stage", "2", "--zero.stage3_max_live_parameters", "5"],
     ["--zero.stage", "3"]),
    ("zero.contiguous_gradients", ["--zero.stage", "2", "--zero.contiguous_gradients", "false"],
     ["--zero.stage", "1"]),
    ("zero.sub_group_size", ["--zero.sub_group_size", "1000"], None),
    ("zero.zero_quantization_block_size", ["--zero.stage", "3", "--zero.zero_quantization_block_size", "64"],
     ["--zero.zero_quantized_weights", "true"]),
    ("optimizer.loss_scale_window", ["--training.precision", "bf16", "--optimizer.loss_scale_window", "500"],
     ["--training.precision", "fp16"]),
    ("parallel.pipeline_schedule", ["--parallel.pipeline_schedule", "afab"], ["--parallel.pp", "2"]),
    ("activation_checkpointing.checkpoint_every", ["--activation_checkpointing.checkpoint_every", "2"],
     ["--activation_checkpointing.checkpoint_activations", "true"]),
    ("logging.eval_steps", ["--logging.eval_interval", "0", "--logging.eval_steps", "7"],
     ["--logging.eval_interval", "10"]),
    ("logging.eval_interval", ["--data.data_path", "a", "--data.tokenizer", "t.model", "--eval-interval", "3"],
     ["--data.eval_path", "e"]),
    ("logging.eval_steps", ["--data.data_path", "a", "--data.tokenizer", "t.model", "--logging.eval_steps", "3"],
     ["--data.eval_path", "e"]),
    ("checkpoint.save_interval", ["--save", "none", "--save-interval", "5"], ["--save", "ck"]),
    ("checkpoint.fallback", ["--load", "none", "--checkpoint.fallback", "true"], ["--load", "auto"]),
    ("data.default_corpus_vocab", ["--data.data_path", "a", "--data.tokenizer", "t.model",
                                   "--data.default_corpus_vocab", "4096"], None),
]


def notes(argv: list[str], world: int = 2) -> list[str]:
    argv = last_wins(["--config", "configs/tiny.yaml", "--tp", "1", *argv])  # a case's flags win
    return no_effect(parse_config(argv).validate(world))


def test_every_rule_names_a_field_of_the_run_config():
    cfg = RunConfig()
    for target, _, _ in RULES:
        section, name = target.split(".")
        assert hasattr(getattr(cfg, section), name), target


@pytest.mark.parametrize("field, off, on", CASES, ids=[c[0] for c in CASES])
def test_a_value_is_noted_exactly_when_its_feature_is_off(field, off, on):
    said = [n for n in notes(off) if n.startswith(f"no effect here: {field}=")]
    assert len(said) == 1, notes(off)
    if on is not None:
        assert not [n for n in notes(off + on) if f" {field}=" in n], notes(off + on)


def test_defaults_are_never_noted_nor_a_value_that_acts():
    assert no_effect(RunConfig().validate(1)) == []
    assert notes([]) == []  # configs/tiny.yaml: every value it sets acts
    assert notes(["--data.default_corpus_vocab", "4096"]) == []  # sizes the built-in corpus it trains on
    assert notes(["--data.data_path", "a", "--data.tokenizer", "t.model", "--eval-interval", "0",
                  "--logging.eval_steps", "5"]) == []  # evaluation turned off where there is nothing to evaluate


def test_a_deepspeed_json_s_disabled_fp16_section_is_noted(tmp_path):
    """Megatron-DeepSpeed's bf16 configs keep an ``fp16`` section with ``enabled: false``: its
    loss-scale keys are applied but act only in fp16, and the user hears so."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"fp16": {"enabled": False, "loss_scale_window": 500, "initial_scale_power": 11},
                              "bf16": {"enabled": True}}))
    cfg = parse_config(["--deepspeed-config", str(ds)], world_size=1).validate(1)
    said = no_effect(cfg)
    assert any(n.startswith("no effect here: optimizer.loss_scale_window=500 (loss scaling is fp16's") for n in said)
    assert any(n.startswith("no effect here: optimizer.initial_loss_scale=2048") for n in said), said
