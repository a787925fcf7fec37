"""Named model shapes: ``tiny`` for CPU tests and the demo, and every model of the ZeRO and
Megatron-LM papers, each with the model-parallel degree (``paper_mp``) the paper ran it at.

Sources:

* ``zero-*``: ZeRO-100B rows of [Z] Appendix Table 5 (Figure 2, ZeRO vs Megatron). The 40B and
  60B rows use hidden 6144 from Table 5, not the 4096 printed in Table 4 (12·l·h² only reaches
  40B / 60B with 6144).
* ``zero-60b-fig3``: [Z] Appendix Table 6 (Figure 3, super-linear scaling), MP 16.
* ``zero-dp-*``: [Z] Appendix Table 10 (Figure 4, DP only, MP 1), including its two DDP
  baselines (``zero-dp-baseline-*``).
* ``megatron-*``: Megatron-LM Table 1 (weak scaling, 96 hidden per head) and Table 2's 355M.

* Llama family (``llama3.*``, ``qwen2.5-*``, ``mistral-7b``): the published ``config.json`` shapes
  (each model's Hugging Face ``config.json``), sequence length the pretraining context (Llama-3 and
  Mistral 8192, Qwen2.5 4096); ``tiny-llama`` the CPU-sized one of ``configs/tiny-llama.yaml``.

The papers do not state the sequence length of these runs; 1024 (the only one [Z] names, §6.1,
and Megatron's) is used. Vocabulary is GPT-2's 50,257, padded at run time
(``GPTConfig.padded_vocab_size``).
"""

from __future__ import annotations

import dataclasses

from zerotron.model.config import GPTConfig

GPT2_VOCAB = 50257
SEQ = 1024

# name: (layers, hidden, heads, paper MP degree)
_PAPER_SHAPES: dict[str, tuple[int, int, int, int]] = {
    # [Z] Appendix Table 5, ZeRO rows
    "zero-1.5b": (48, 1600, 16, 1),
    "zero-8b": (72, 3072, 24, 4),
    "zero-40b": (88, 6144, 32, 4),
    "zero-60b": (132, 6144, 32, 16),
    "zero-80b": (100, 8192, 64, 16),
    "zero-100b": (125, 8192, 64, 16),
    "zero-120b": (150, 8192, 64, 16),
    "zero-140b": (175, 8192, 64, 16),
    "zero-170b": (212, 8192, 64, 16),
    # [Z] Appendix Table 6
    "zero-60b-fig3": (75, 8192, 32, 16),
    # [Z] Appendix Table 10 (DP only)
    "zero-dp-1.5b": (34, 1920, 16, 1),
    "zero-dp-2.5b": (54, 1920, 16, 1),
    "zero-dp-4b": (64, 2304, 24, 1),
    "zero-dp-6b": (52, 3072, 24, 1),
    "zero-dp-8b": (72, 3072, 24, 1),
    "zero-dp-10b": (50, 4096, 32, 1),
    "zero-dp-11b": (54, 4096, 32, 1),
    "zero-dp-12b": (58, 4096, 32, 1),
    "zero-dp-13b": (62, 4096, 32, 1),
    "zero-dp-baseline-1.16b": (24, 1920, 16, 1),
    "zero-dp-baseline-1.38b": (40, 1536, 16, 1),
    # Megatron-LM Table 1 (MP-only weak scaling) and Table 2
    "megatron-1.2b": (40, 1536, 16, 1),
    "megatron-2.5b": (54, 1920, 20, 2),
    "megatron-4.2b": (64, 2304, 24, 4),
    "megatron-8.3b": (72, 3072, 32, 8),
    "megatron-355m": (24, 1024, 16, 1),
}

PRESETS: dict[str, GPTConfig] = {
    # Small enough for 2-core CPU tests and the demo; vocab is a multiple of 128 so tp 1..4 pad
    # predictably, and 4 heads split over tp = 1, 2 or 4.
    "tiny": GPTConfig(num_layers=4, hidden_size=64, num_heads=4, vocab_size=512, seq_length=128,
                      paper_mp=1, name="tiny"),
    **{
        name: GPTConfig(num_layers=l, hidden_size=h, num_heads=nh, vocab_size=GPT2_VOCAB, seq_length=SEQ,
                        dropout=0.1, attention_dropout=0.1, paper_mp=mp, name=name)
        for name, (l, h, nh, mp) in _PAPER_SHAPES.items()
    },
}


# name: (layers, hidden, ffn, heads, kv heads, vocab, rope theta, Llama-3.1 scaling factor, tied)
_LLAMA_SHAPES: dict[str, tuple] = {
    "llama3.2-1b": (16, 2048, 8192, 32, 8, 128256, 500000.0, 32.0, True),
    "llama3.2-3b": (28, 3072, 8192, 24, 8, 128256, 500000.0, 32.0, True),
    "llama3.1-8b": (32, 4096, 14336, 32, 8, 128256, 500000.0, 8.0, False),
    "llama3.1-70b": (80, 8192, 28672, 64, 8, 128256, 500000.0, 8.0, False),
    "llama3.1-405b": (126, 16384, 53248, 128, 8, 128256, 500000.0, 8.0, False),
    "qwen2.5-0.5b": (24, 896, 4864, 14, 2, 151936, 1e6, None, True),
    "qwen2.5-7b": (28, 3584, 18944, 28, 4, 152064, 1e6, None, False),
    "qwen2.5-72b": (80, 8192, 29568, 64, 8, 152064, 1e6, None, False),
    "mistral-7b": (32, 4096, 14336, 32, 8, 32768, 1e6, None, False),
}


def _llama(name: str, layers, hidden, ffn, heads, groups, vocab, theta, scaling, tied) -> GPTConfig:
    qwen = name.startswith("qwen")
    return GPTConfig(num_layers=layers, hidden_size=hidden, num_heads=heads, vocab_size=vocab,
                     seq_length=4096 if qwen else 8192, ffn_hidden_size=ffn,
                     num_query_groups=groups, position_embedding_type="rope", rotary_base=theta,
                     rope_scaling=scaling is not None, rope_scaling_factor=scaling or 8.0,
                     normalization="RMSNorm", layernorm_eps=1e-6 if qwen else 1e-5,
                     activation="swiglu", add_bias_linear=False, add_qkv_bias=qwen,
                     untie_embeddings_and_output_weights=not tied, name=name)


PRESETS.update({name: _llama(name, *shape) for name, shape in _LLAMA_SHAPES.items()})
# CPU-sized: RoPE, RMSNorm, SwiGLU, GQA 2:1, untied; 2 query groups split over tp = 1 or 2
PRESETS["tiny-llama"] = GPTConfig(
    num_layers=4, hidden_size=64, num_heads=4, num_query_groups=2, vocab_size=512, seq_length=128,
    ffn_hidden_size=176, position_embedding_type="rope", normalization="RMSNorm",
    activation="swiglu", add_bias_linear=False, untie_embeddings_and_output_weights=True,
    name="tiny-llama")


def get_preset(name: str, **overrides) -> GPTConfig:
    """A fresh copy of preset ``name`` with ``overrides`` applied (e.g. ``seq_length=512``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    try:
        return dataclasses.replace(PRESETS[name], **overrides)
    except TypeError as exc:
        fields = sorted(f.name for f in dataclasses.fields(GPTConfig))
        raise ValueError(f"get_preset({name!r}): bad override ({exc}); GPTConfig fields are {fields}") from exc
