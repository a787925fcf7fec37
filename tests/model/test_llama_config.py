"""Start-up errors of the Llama-family fields: each names the field, the value and the fix, and
comes from checks that run before any process group (``GPTConfig.validate``,
``setup_run.validate_model``)."""

from __future__ import annotations

import dataclasses

import pytest

from zerotron.model import get_preset


@pytest.mark.parametrize("change,tp,message", [
    (dict(num_query_groups=6), 4,
     "model.num_query_groups=6 is not divisible by parallel.tp=4: each TP rank holds whole"),
    (dict(num_query_groups=5), 1,
     "model.num_query_groups=5: must be a positive integer dividing model.num_heads=24"),
    (dict(normalization="rmsnorm"), 1,
     "model.normalization='rmsnorm': use one of LayerNorm, RMSNorm"),
    (dict(activation="geglu"), 1, "model.activation='geglu': use one of gelu, swiglu"),
    (dict(rope_scaling=True, rope_scaling_high_freq_factor=1.0), 1,
     "model.rope_scaling_high_freq_factor=1.0 must exceed model.rope_scaling_low_freq_factor=1.0"),
    (dict(reset_attention_mask=True, attention_dropout=0.1), 1,
     "model.attention_dropout=0.1 with model.reset_attention_mask"),
])
def test_bad_architecture_fields_are_named(change, tp, message):
    cfg = dataclasses.replace(get_preset("tiny-llama"), num_heads=24, hidden_size=48, **change)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cfg.validate(tp)


def test_document_masking_with_a_pipeline_is_refused_before_start():
    from zerotron.config.run_config import ConfigError, RunConfig
    from zerotron.training.setup_run import validate_model

    cfg = RunConfig()
    cfg.model.preset, cfg.model.reset_attention_mask, cfg.parallel.pp = "tiny-llama", True, 2
    with pytest.raises(ConfigError, match="model.reset_attention_mask/reset_position_ids with "
                                          "parallel.pp=2: .* use parallel.pp=1"):
        validate_model(cfg)
    cfg.parallel.pp = 1
    assert validate_model(cfg).eod_token_id == 2  # the built-in tokenizer's until the run reads it
