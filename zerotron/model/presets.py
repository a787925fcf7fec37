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


def get_preset(name: str, **overrides) -> GPTConfig:
    """A fresh copy of preset ``name`` with ``overrides`` applied (e.g. ``seq_length=512``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    try:
        return dataclasses.replace(PRESETS[name], **overrides)
    except TypeError as exc:
        fields = sorted(f.name for f in dataclasses.fields(GPTConfig))
        raise ValueError(f"get_preset({name!r}): bad override ({exc}); GPTConfig fields are {fields}") from exc
