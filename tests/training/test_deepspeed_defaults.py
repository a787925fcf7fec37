"""What DeepSpeed makes of what a JSON leaves out, sets to 0 or null, or spells loosely, held
against DeepSpeed's source: a scheduler's own defaults (``runtime/lr_schedules.py``), the
``ge=0`` ZeRO sizes and ``Optional`` sections of ``runtime/zero/config.py``, the ZeRO++ keys
that only stage 3 reads, the Hugging Face Trainer's batch rule, and the run-config values that
zerotron keeps where DeepSpeed's default differs, each said at start-up."""

from __future__ import annotations

import json

import pytest

from zerotron.training.cli import parse_config
from zerotron.training.deepspeed import from_deepspeed
from zerotron.training.schedule import lr_at


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
