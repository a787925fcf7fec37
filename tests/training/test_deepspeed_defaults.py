"""What DeepSpeed makes of what a JSON leaves out, sets to 0 or null, or spells loosely, held
against DeepSpeed's source: a scheduler's own defaults (``runtime/lr_schedules.py``), the
``ge=0`` ZeRO sizes and ``Optional`` sections of ``runtime/zero/config.py``, the ZeRO++ keys
that only stage 3 reads, the Hugging Face Trainer's batch rule, and the run-config values that
zerotron keeps where DeepSpeed's default differs, each said at start-up."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from zerotron.config.cli import parse_config
from zerotron.config.deepspeed import from_deepspeed
from zerotron.zero.lr_schedule import lr_at

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "training" / "deepspeed_configs"


def test_warmup_lr_without_a_peak_warms_up_to_deepspeeds_default():
    """``WarmupLR(warmup_max_lr=0.001)``: the optimizer's own rate is replaced, not the peak."""
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    cfg, lines = from_deepspeed(ds)
    o = cfg.validate(1).optimizer
    assert o.lr == 0.001 and lr_at(50, o, 100) == 0.001
    assert any("scheduler.params.warmup_max_lr not given: 0.001 (WarmupLR's default; the warm-up ends there"
               in line for line in lines), lines
    cosine = {**ds, "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100}}}
    assert from_deepspeed(cosine)[0].validate(1).optimizer.lr == 3e-4  # a ratio of the optimizer's rate


def test_a_min_lr_the_schedule_never_reaches_is_not_refused():
    """HF's tests' ZeRO-3 config (lr 3e-5, WarmupLR: constant after the warm-up) on configs/tiny.yaml
    (min_lr 3e-4): DeepSpeed's WarmupLR has no floor, so the YAML's is only said to do nothing."""
    from zerotron.config.inert import no_effect

    argv = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--deepspeed-config", str(CONFIGS / "hf_tests_zero3.json")]
    cfg = parse_config(argv, world_size=4).validate(4)
    assert (cfg.optimizer.lr, cfg.optimizer.decay) == (3e-5, "constant")
    assert "no effect here: optimizer.min_lr=0.0003 (the rate does not decay: optimizer.decay=constant)" \
        in no_effect(cfg)


def test_a_min_lr_above_the_jsons_rate_names_the_flag_that_fixes_it():
    """DeepSpeedExamples' Megatron ZeRO-2 config (lr 1.5e-4, no scheduler section) on configs/tiny.yaml:
    the YAML's cosine schedule runs, as under Megatron-DeepSpeed, and would decay *up* to 3e-4."""
    from zerotron.config.run_config import ConfigError

    argv = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--deepspeed-config",
            str(CONFIGS / "dsexamples_megatron_zero2_static.json")]
    with pytest.raises(ConfigError) as err:
        parse_config(argv, world_size=4).validate(4)
    assert "optimizer.params.lr (read as optimizer.lr): optimizer.min_lr=0.0003 must be between 0 and " \
           "optimizer.lr=0.00015" in str(err.value) and "--optimizer.min_lr 1.5e-05" in str(err.value)
    assert parse_config(argv + ["--optimizer.min_lr", "1.5e-05"], world_size=4).validate(4).optimizer.min_lr == 1.5e-5


def test_precision_and_stage_left_out_keep_the_run_configs_and_say_so(tmp_path, capsys):
    """DeepSpeed's defaults are fp32 and stage 0; like a missing ``gradient_clipping``, a missing
    precision section or stage keeps the YAML's value, with a line -- none where a flag decided."""
    yml, ds = tmp_path / "run.yaml", tmp_path / "ds.json"
    yml.write_text("training: {precision: bf16}\nzero: {stage: 2}\n")
    ds.write_text(json.dumps({"zero_optimization": {"overlap_comm": True}, "fp16": {"enabled": False}}))
    cfg = parse_config(["--config", str(yml), "--deepspeed-config", str(ds)], world_size=1)
    assert (cfg.training.precision, cfg.zero.stage) == ("bf16", 2)
    out = capsys.readouterr().out
    assert "zero_optimization.stage not given: zero.stage stays the run config's 2 (DeepSpeed's default 0" in out
    assert "bf16 not given: training.precision stays the run config's bf16 (DeepSpeed's default would train " \
           "in fp32" in out
    ds.write_text("{}")
    parse_config(["--config", str(yml), "--deepspeed-config", str(ds)], world_size=1)
    assert "zero_optimization not given: zero.stage stays the run config's 2" in capsys.readouterr().out
    parse_config(["--config", str(yml), "--deepspeed-config", str(ds), "--precision", "bf16", "--zero-stage", "2"],
                 world_size=1)
    assert "not given" not in capsys.readouterr().out.replace("gradient_clipping not given", "")


def test_zeropp_keys_below_stage_3_have_no_effect(capsys):
    """The ZeRO++ config run at ``--zero-stage 2``: DeepSpeed's stage 1-2 optimizer never reads qwZ,
    hpZ or qgZ, so the gradients are not quantized and nothing is refused."""
    argv = ["--deepspeed-config", str(CONFIGS / "zeropp_fp16.json"), "--zero-stage", "2"]
    z = parse_config(argv, world_size=2).validate(2).zero
    assert (z.stage, z.zero_quantized_weights, z.zero_hpz_partition_size, z.zero_quantized_gradients) == \
        (2, False, 1, False)
    out = capsys.readouterr().out
    for key in ("zero_quantized_weights", "zero_hpz_partition_size", "zero_quantized_gradients"):
        assert f"accepted, no effect here: zero_optimization.{key} (DeepSpeed runs ZeRO++ (qwZ, hpZ, qgZ) at " \
               f"stage 3 only: zero.stage=2)" in out, out
    three = parse_config(argv[:2], world_size=2).validate(2).zero
    assert (three.zero_quantized_weights, three.zero_hpz_partition_size, three.zero_quantized_gradients) == \
        (True, 2, True)


def test_an_auto_train_batch_size_is_micro_x_accumulation_x_dp():
    """The Hugging Face Trainer fills ``train_batch_size`` with ``world x micro x gas``: beside a given
    micro batch and accumulation count, "auto" is their product, not the run config's global batch."""
    ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}
    cfg, lines = from_deepspeed(ds, world_size=4)  # the run config's global batch is 16
    assert (cfg.training.global_batch_size, cfg.validate(4).num_microbatches) == (32, 4)
    assert "train_batch_size: auto -> 32 (train_micro_batch_size_per_gpu x gradient_accumulation_steps x dp = " \
           "2 x 4 x 4, the Hugging Face Trainer's rule)" in lines
    everything_auto = dict.fromkeys(ds, "auto")
    assert from_deepspeed(everything_auto, world_size=2)[0].training.global_batch_size == 16  # the run config's


def test_null_optional_sections_are_left_out():
    """``offload_param`` / ``offload_optimizer`` / ``overlap_comm`` are ``Optional`` in DeepSpeed's
    ZeRO model: null is the default (no offload; overlap on at stage 3 only)."""
    z = {"stage": 3, "offload_param": None, "offload_optimizer": None, "overlap_comm": None}
    cfg, _ = from_deepspeed({"zero_optimization": z})
    assert (cfg.zero.offload_param_device, cfg.zero.optimizer_offload, cfg.zero.overlap_comm) == ("none", "none", True)


@pytest.mark.parametrize("legacy, stage", [(True, 1), (False, 0)])
def test_a_boolean_zero_optimization_is_the_deprecated_stage_1_or_0(legacy, stage):
    """``read_zero_config_deprecated``: true is stage 1 with the top-level ``allgather_size`` as its
    all-gather bucket; false is stage 0."""
    cfg, lines = from_deepspeed({"zero_optimization": legacy, "allgather_size": 2e8})
    assert cfg.zero.stage == stage
    assert cfg.zero.allgather_bucket_size == (200_000_000 if legacy else 500_000_000)
    assert any(f"zero_optimization: {str(legacy).lower()} is DeepSpeed's deprecated spelling of {{\"stage\": {stage}}}"
               in line for line in lines), lines
    assert any("accepted, no effect here: allgather_size" in line for line in lines) is not legacy


def test_pydantic_sections_coerce_as_deepspeed_does_and_only_those():
    """DeepSpeed's ZeRO, offload and (newest) fp16/bf16 models are pydantic in lax mode: "2" is 2,
    "false" is false. The scheduler's params and activation checkpointing it reads as given, so a
    string there stays refused (``"false"`` would even be a true value in DeepSpeed)."""
    ds = {"zero_optimization": {"stage": "2", "contiguous_gradients": "false", "reduce_bucket_size": "1000000",
                                "offload_optimizer": {"device": "cpu", "pin_memory": "true"}},
          "fp16": {"enabled": "true", "initial_scale_power": "12"}, "bf16": {"enabled": 0}}
    cfg, _ = from_deepspeed(ds)
    assert (cfg.zero.stage, cfg.zero.contiguous_gradients, cfg.zero.reduce_bucket_size) == (2, False, 1_000_000)
    assert (cfg.zero.optimizer_offload, cfg.training.precision, cfg.optimizer.initial_loss_scale) == \
        ("cpu", "fp16", 4096.0)
    for bad, needle in [({"zero_optimization": {"stage": "two"}}, "zero_optimization.stage='two': DeepSpeed reads "
                                                                   "it as int and refuses it"),
                        ({"zero_optimization": {"overlap_comm": "maybe"}}, "overlap_comm='maybe'"),
                        ({"activation_checkpointing": {"partition_activations": "false"}}, "must be true or false"),
                        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "10"}}}, "integer"),
                        ({"bf16": {"enabled": True, "check_overflow": True}},
                         "bf16.check_overflow: not a DeepSpeed key in bf16 (did you mean check_grad_overflow?)")]:
        with pytest.raises(ValueError, match=re.escape(needle)):
            from_deepspeed(bad)


def test_check_grad_overflow_says_what_zerotron_does_instead():
    """Newest DeepSpeed skips a bf16 step with a non-finite gradient when ``check_grad_overflow`` is
    true (its default); zerotron never skips one -- its NaN check stops the run -- and says so."""
    _, lines = from_deepspeed({"bf16": {"enabled": True, "check_grad_overflow": True}})
    assert "bf16.check_grad_overflow=true: a non-finite bf16 gradient norm stops the run at zerotron's next check " \
           "(each log interval and checkpoint), instead of skipping the step as DeepSpeed does" in lines
    assert not any("no effect here: bf16.check_grad_overflow" in line for line in lines)
