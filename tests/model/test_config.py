"""GPTConfig validation, vocabulary padding, presets and parameter counts (single process).

Reference: the [N21] Eq. 2 formula evaluated here in floating point, the papers' shapes typed in
from their tables (ZeRO Tables 4-10, Megatron-LM Table 1), and the parameters an actual (tp=1)
GPT allocates.
"""

import dataclasses

import pytest

from zerotron.model import PRESETS, GPTConfig, get_preset

# (layers, hidden, heads, MP) as printed in [Z] Tables 5, 6, 10 and [M] Table 1
PAPER = {
    "zero-1.5b": (48, 1600, 16, 1), "zero-8b": (72, 3072, 24, 4), "zero-40b": (88, 6144, 32, 4),
    "zero-60b": (132, 6144, 32, 16), "zero-80b": (100, 8192, 64, 16), "zero-100b": (125, 8192, 64, 16),
    "zero-120b": (150, 8192, 64, 16), "zero-140b": (175, 8192, 64, 16), "zero-170b": (212, 8192, 64, 16),
    "zero-60b-fig3": (75, 8192, 32, 16), "zero-dp-13b": (62, 4096, 32, 1), "zero-dp-4b": (64, 2304, 24, 1),
    "megatron-1.2b": (40, 1536, 16, 1), "megatron-2.5b": (54, 1920, 20, 2),
    "megatron-4.2b": (64, 2304, 24, 4), "megatron-8.3b": (72, 3072, 32, 8),
}


def formula(cfg, tp=1):
    l, h, s, v = cfg.num_layers, cfg.hidden_size, cfg.seq_length, cfg.padded_vocab_size(tp)
    return 12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))


def test_presets_match_papers_and_validate_at_their_mp():
    for name, (l, h, nh, mp) in PAPER.items():
        c = get_preset(name)
        assert (c.num_layers, c.hidden_size, c.num_heads, c.paper_mp) == (l, h, nh, mp), name
    for name, c in PRESETS.items():
        c.validate(c.paper_mp)
        if c.architecture != "gpt2":  # the Llama family: tests/estimate/test_llama_params.py
            continue
        assert c.num_params() == pytest.approx(formula(c), rel=1e-12), name
        assert c.exact_num_params() == c.num_params() + 2 * c.hidden_size  # + final LayerNorm


def test_nominal_sizes():
    assert get_preset("megatron-8.3b").num_params() == pytest.approx(8.3e9, rel=0.01)
    assert get_preset("zero-100b").num_params() == pytest.approx(100e9, rel=0.03)
    assert get_preset("zero-40b").num_params() == pytest.approx(40e9, rel=0.02)
    assert get_preset("zero-1.5b").num_params() == pytest.approx(1.5e9, rel=0.06)
    tiny = get_preset("tiny")
    assert (tiny.num_layers, tiny.hidden_size, tiny.num_heads, tiny.seq_length) == (4, 64, 4, 128)


def test_vocab_padding():
    c = get_preset("megatron-8.3b")
    assert c.padded_vocab_size(8) == 51200  # Megatron-LM §5.1
    assert c.padded_vocab_size(1) == 50304
    assert GPTConfig(1, 8, 2, 100, 4, make_vocab_size_divisible_by=8).padded_vocab_size(4) == 128


def test_get_preset_copies_and_overrides():
    c = get_preset("tiny", seq_length=64, dropout=0.1)
    assert c.seq_length == 64 and c.dropout == 0.1 and PRESETS["tiny"].seq_length == 128
    with pytest.raises(ValueError, match="unknown model preset 'nope'"):
        get_preset("nope")
    with pytest.raises(ValueError, match="bad override"):
        get_preset("tiny", hiden_size=3)


@pytest.mark.parametrize("change,tp,field", [
    (dict(hidden_size=66), 1, "model.hidden_size=66 is not divisible by model.num_heads=4"),
    (dict(hidden_size=96, num_heads=6), 4, "model.num_heads=6 is not divisible by parallel.tp=4"),
    (dict(hidden_size=36), 8, "model.hidden_size=36 is not divisible by parallel.tp=8"),
    (dict(max_position_embeddings=64), 1, "model.seq_length=128 exceeds the position table"),
    (dict(num_layers=0), 1, "model.num_layers=0"),
    (dict(dropout=1.0), 1, "model.dropout=1.0"),
    (dict(init_std=0.0), 1, "model.init_std"),
    (dict(gelu_approximate="fast"), 1, "model.gelu_approximate"),
    (dict(), 0, "parallel.tp=0"),
])
def test_validation_names_field_value_and_fix(change, tp, field):
    cfg = dataclasses.replace(get_preset("tiny"), **change)
    with pytest.raises(ValueError) as err:
        cfg.validate(tp)
    assert field in str(err.value)
