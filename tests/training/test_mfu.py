"""Logged MFU and HFU against the FLOPs the trainer's step really dispatches.

The reference is not ``model.flops``: torch's ``FlopCounterMode`` counts every matmul of one
real ``Trainer.train_step`` (attention on the math kernel so its two batched GEMMs are visible),
once with activation checkpointing -- the recompute pass included, what the device did -- and
once without, the model's own FLOPs. The model has ``ffn_hidden_size`` = 1.5h and a vocabulary
the model pads (1024 -> 1100), so a formula that ignored either would not match the count.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness import spawn
from tests.training.test_trainer import make_config

PEAK = 0.5  # TFLOP/s, logging.peak_tflops: a CPU has no table entry


def counted_run(run_dir, cache, checkpointing: bool, *extra: str):
    """The matmul FLOPs of step 1 (counted), then metrics.jsonl of steps 2-3 (log interval 1)."""
    import torch.distributed as dist
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from zerotron.parallel.runtime import init_distributed
    from zerotron.training.build_run import build_run
    from zerotron.training.trainer import Trainer

    flags = ["--train-steps", "3", "--log-interval", "1", "--logging.peak_tflops", str(PEAK),
             "--model.ffn_hidden_size", "96", "--model.make_vocab_size_divisible_by", "100"]
    flags += ["--checkpoint-activations"] if checkpointing else []
    flags += list(extra)
    cfg = make_config(run_dir, cache, *flags).validate(dist.get_world_size())
    trainer = Trainer(build_run(cfg, init_distributed()))
    assert trainer.mcfg.padded_vocab_size(1) != trainer.mcfg.vocab_size
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        trainer.train_step()
    trainer.train()
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return counter.get_total_flops(), records


def both_runs(tmp_path, cache):
    return counted_run(tmp_path / "ckpt", cache, True), counted_run(tmp_path / "plain", cache, False)


def test_mfu_counts_model_flops_and_hfu_the_recompute(zerotron_cache, tmp_path):
    ((hw, ckpt_records), (model, plain_records)), = spawn(both_runs, 1, tmp_path, zerotron_cache, timeout=120)
    assert 1.2 < hw / model < 4 / 3  # the recompute pass: 4/3 of the layer terms, the logits once
    assert [r["step"] for r in ckpt_records] == [r["step"] for r in plain_records] == [2, 3]
    for rec in ckpt_records:
        assert rec["hfu"] / rec["mfu"] == pytest.approx(hw / model, rel=1e-9)
        assert rec["mfu"] == pytest.approx(model / rec["step_time_s"] / 1e12 / PEAK, rel=1e-9)
        assert rec["tflops_per_device"] == pytest.approx(hw / rec["step_time_s"] / 1e12, rel=1e-9)
    for rec in plain_records:
        assert rec["mfu"] == rec["hfu"] == pytest.approx(model / rec["step_time_s"] / 1e12 / PEAK, rel=1e-9)


def test_hfu_counts_the_selective_recompute(zerotron_cache, tmp_path):
    """Selective recompute runs the attention core again in backward: HFU counts it, MFU not."""
    (hw, records), = spawn(counted_run, 1, tmp_path / "sel", zerotron_cache, False,
                           "--recompute-granularity", "selective", timeout=120)
    assert [r["step"] for r in records] == [2, 3]
    for rec in records:
        assert rec["tflops_per_device"] == pytest.approx(hw / rec["step_time_s"] / 1e12, rel=1e-9)
        assert rec["hfu"] > rec["mfu"]


def test_mfu_of_the_llama_block_equals_the_count(zerotron_cache, tmp_path):
    """tiny-llama: GQA's smaller K/V (2 query groups of 4 heads), SwiGLU's gate and up GEMM, the
    untied output layer; MFU's FLOPs are the count of its real step."""
    (model, records), = spawn(counted_run, 1, tmp_path / "llama", zerotron_cache, False,
                              "--model.preset", "tiny-llama", timeout=120)
    for rec in records:
        counted = model / rec["step_time_s"] / 1e12 / PEAK
        assert rec["mfu"] == rec["hfu"] == pytest.approx(counted, rel=1e-9)
