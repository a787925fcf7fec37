"""FLOP formulas and the peak-TFLOPs table.

Reference: [N21]'s per-term derivation written out here -- forward layer 24Bsh² + 4Bs²h,
backward 2× forward, one more forward with full recompute, logits 6BshV -- which must equal the
closed forms in zerotron.model.flops; and the reference file's 8.3B / 512-GPU / 15.1 PFLOPs claim.
"""

import pytest
import torch

from zerotron.model import GPTConfig, flops_per_iteration, get_preset, peak_tflops, throughput


def by_terms(cfg, B, s, recompute):
    l, h, V = cfg.num_layers, cfg.hidden_size, cfg.padded_vocab_size(1)
    layer_fwd = 24 * B * s * h * h + 4 * B * s * s * h
    passes = 4 if recompute else 3
    return passes * layer_fwd * l + 6 * B * s * h * V


@pytest.mark.parametrize("name", ["tiny", "megatron-8.3b", "zero-100b"])
@pytest.mark.parametrize("recompute", [True, False])
def test_closed_forms_equal_term_sums(name, recompute):
    cfg = get_preset(name)
    got = flops_per_iteration(cfg, batch=8, seq=cfg.seq_length, recompute=recompute)
    assert got == pytest.approx(by_terms(cfg, 8, cfg.seq_length, recompute), rel=1e-12)


def test_recompute_costs_about_a_third_more():
    cfg = get_preset("megatron-8.3b")
    ratio = flops_per_iteration(cfg, 512, 1024, True) / flops_per_iteration(cfg, 512, 1024, False)
    assert 1.30 < ratio < 1.34


def test_peak_table_and_override(monkeypatch):
    monkeypatch.delenv("ZEROTRON_PEAK_TFLOPS", raising=False)
    assert peak_tflops("NVIDIA H200", torch.bfloat16) == 989.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == 312.0
    assert peak_tflops("Tesla V100-SXM2-32GB", torch.float16) == 125.0
    assert peak_tflops("Tesla V100-SXM2-32GB", torch.bfloat16) is None
    assert peak_tflops("NVIDIA H100 80GB HBM3", torch.float32) == 67.0
    assert peak_tflops("cpu", torch.float32) is None
    assert peak_tflops("cpu", torch.float32, override=1.5) == 1.5
    monkeypatch.setenv("ZEROTRON_PEAK_TFLOPS", "2.0")
    assert peak_tflops("cpu") == 2.0
    with pytest.raises(ValueError, match="override"):
        peak_tflops("cpu", override=-1.0)


def test_throughput_matches_megatron_claim():
    # [M]: 8.3B on 512 V100s, global batch 512, seq 1024, with checkpointing: ~15.1 PFLOPs
    cfg = get_preset("megatron-8.3b")
    per_iter = flops_per_iteration(cfg, 512, 1024, recompute=True, tp=8)
    seconds = per_iter / 15.1e15  # iteration time implied by 15.1 PFLOPs
    out = throughput(cfg, 512, seconds, 512, recompute=True, peak=125.0, tp=8)
    assert out["tflops_per_device"] == pytest.approx(15.1e3 / 512, rel=1e-9)
    assert 0.17 < out["mfu"] < 0.24
    assert throughput(cfg, 1, 1.0, 1)["mfu"] is None
    with pytest.raises(ValueError):
        throughput(GPTConfig(1, 8, 2, 16, 4), 1, 0.0, 1)
