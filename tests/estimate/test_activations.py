"""Korthikanti et al. 2022 Table 2 in the memory model: the general per-layer formula
(``estimate.activations``) against the table as printed, and how ``estimate`` uses it.

The measured side (autograd's saved tensors and the allocator, per layer, at TP 2) is
``tests/activation/test_selective_recompute.py``.
"""

import dataclasses

import pytest

from zerotron.estimate.activations import korthikanti_table2, layer_activation_bytes
from zerotron.estimate.memory_model import Setup, estimate
from zerotron.model.presets import PRESETS


@pytest.mark.parametrize("s,b,h,a,t", [(2048, 1, 12288, 96, 8), (1024, 4, 4096, 32, 2), (128, 2, 256, 8, 4)])
def test_general_formula_is_table2_with_16_bit_values_and_byte_masks(s, b, h, a, t):
    rows = korthikanti_table2(s, b, h, a, t)
    got = {
        "none": layer_activation_bytes(b, s, h, a, 1),
        "tp": layer_activation_bytes(b, s, h, a, t),
        "tp+sp": layer_activation_bytes(b, s, h, a, t, sequence_parallel=True),
        "tp+selective": layer_activation_bytes(b, s, h, a, t, recompute="selective"),
        "tp+sp+selective": layer_activation_bytes(b, s, h, a, t, sequence_parallel=True, recompute="selective"),
        "full": layer_activation_bytes(b, s, h, a, t, recompute="full"),
    }
    for name, want in rows.items():
        assert got[name] == pytest.approx(want, rel=1e-12), name
    assert got["tp+sp+selective"] == s * b * h * 34 / t  # the paper's headline: 34/t of s·b·h
    with pytest.raises(ValueError, match="recompute='partial'"):
        layer_activation_bytes(b, s, h, a, t, recompute="partial")


def test_estimate_splits_activations_with_sequence_parallelism():
    cfg = PRESETS["zero-1.5b"]
    base = Setup(cfg, tp=4, dp=2, micro_batch=2, checkpoint_activations=True)
    sp = dataclasses.replace(base, sequence_parallel=True)
    assert estimate(sp)["checkpoints_device"] * 4 == estimate(base)["checkpoints_device"]
    pa = dataclasses.replace(base, partition_activations=True)
    sp_pa = dataclasses.replace(sp, partition_activations=True)
    # Pa with SP is redundant: the same checkpoints, and no Pa all-gather buffer
    assert estimate(sp_pa)["checkpoints_device"] == estimate(sp)["checkpoints_device"]
    assert estimate(sp_pa)["fixed_buffers"] == estimate(sp)["fixed_buffers"] < estimate(pa)["fixed_buffers"]
    plain = dataclasses.replace(base, checkpoint_activations=False, fused_attention=False)
    selective = dataclasses.replace(plain, recompute_granularity="selective")
    b, s, h, a = 2, cfg.seq_length, cfg.hidden_size, cfg.num_heads
    probs = s * b * h * 5 * a * s / (h * 4) * cfg.num_layers  # Table 2's attention-core term, t = 4
    assert estimate(plain)["checkpoints_device"] - estimate(selective)["checkpoints_device"] == pytest.approx(probs)
