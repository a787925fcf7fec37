"""GPT configuration: the model's shape, validated once against the tensor-parallel size.

The architecture is GPT-2's (the family both the ZeRO paper §10.1 and Megatron-LM §5 train):
learned positions, pre-LayerNorm blocks, a 4h GeLU MLP, tied input/output embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GPTConfig:
    """Shape and regularisation of a GPT-2-style model.

    ``dropout`` is the hidden/residual (and embedding) dropout, applied outside TP regions;
    ``attention_dropout`` drops attention probabilities inside the TP region (per-rank stream).
    ``paper_mp`` records the model-parallel degree the source paper used for this shape.
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int
    seq_length: int
    dropout: float = 0.0
    attention_dropout: float = 0.0
    make_vocab_size_divisible_by: int = 128
    init_std: float = 0.02
    layernorm_eps: float = 1e-5
    ffn_hidden_size: int | None = None  # None: 4 * hidden_size (GPT-2)
    max_position_embeddings: int | None = None  # None: seq_length
    gelu_approximate: str = "tanh"  # GPT-2's "gelu_new"; "none" for the erf form
    paper_mp: int = 1
    name: str = ""

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings if self.max_position_embeddings is not None else self.seq_length

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Vocabulary padded to a multiple of ``make_vocab_size_divisible_by * tp``.

        Megatron-LM §5.1 pads GPT-2's 50,257 tokens to 51,200 (a multiple of 128·8) so the
        embedding splits evenly over TP ranks and GEMM shapes stay tensor-core friendly. The
        padded entries are masked out of the softmax (``cross_entropy``).
        """
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def validate(self, tp: int = 1) -> "GPTConfig":
        """Raise ValueError naming the field, its value and the fix; returns self when valid."""
        derived = ("ffn_hidden_size", "max_position_embeddings")  # None: from hidden_size / seq_length
        for field in ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_length",
                      "make_vocab_size_divisible_by", *derived):
            value = getattr(self, field)
            if value is None and field in derived:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                null = ", or null for the default" if field in derived else ""
                raise ValueError(f"model.{field}={value!r}: must be a positive integer{null}")
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"parallel.tp={tp!r}: must be a positive integer")
        for field in ("dropout", "attention_dropout"):
            value = getattr(self, field)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"model.{field}={value}: must be in [0, 1); use 0 to disable dropout")
        if self.init_std <= 0:
            raise ValueError(f"model.init_std={self.init_std}: must be > 0 (GPT-2 uses 0.02)")
        if self.layernorm_eps <= 0:
            raise ValueError(f"model.layernorm_eps={self.layernorm_eps}: must be > 0 (e.g. 1e-5)")
        if self.gelu_approximate not in ("tanh", "none"):
            raise ValueError(f"model.gelu_approximate={self.gelu_approximate!r}: use 'tanh' or 'none'")
        h, nh = self.hidden_size, self.num_heads
        if h % nh:
            raise ValueError(f"model.hidden_size={h} is not divisible by model.num_heads={nh}; "
                             f"choose num_heads dividing hidden_size (e.g. {_divisor_near(h, nh)})")
        if h % tp:
            raise ValueError(f"model.hidden_size={h} is not divisible by parallel.tp={tp}; "
                             f"use a tp that divides {h}")
        if nh % tp:
            raise ValueError(f"model.num_heads={nh} is not divisible by parallel.tp={tp}: attention splits "
                             f"whole heads over TP ranks; use a tp that divides {nh} or change num_heads")
        if self.ffn_size % tp:
            raise ValueError(f"model.ffn_hidden_size={self.ffn_size} is not divisible by parallel.tp={tp}; "
                             f"use a tp that divides it")
        if self.max_positions < self.seq_length:
            raise ValueError(f"model.seq_length={self.seq_length} exceeds the position table "
                             f"(model.max_position_embeddings={self.max_positions}); raise "
                             f"model.max_position_embeddings to >= {self.seq_length} or shorten model.seq_length")
        return self

    def num_params(self, tp: int = 1) -> int:
        """Parameter count by [N21] Eq. 2: P = 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h)).

        V is the padded vocabulary at ``tp`` and s the position table. Equals 12lh² + 13lh +
        (V+s)h, i.e. every parameter except the final LayerNorm's 2h (see ``exact_num_params``).
        """
        l, h, s, v = self.num_layers, self.hidden_size, self.max_positions, self.padded_vocab_size(tp)
        return 12 * l * h * h + 13 * l * h + (v + s) * h  # the formula, expanded to stay exact

    def exact_num_params(self, tp: int = 1) -> int:
        """Every parameter of ``GPT`` (tied embedding counted once), summed over TP ranks."""
        l, h, f = self.num_layers, self.hidden_size, self.ffn_size
        block = (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
        return l * block + (self.padded_vocab_size(tp) + self.max_positions) * h + 2 * h


def _divisor_near(n: int, target: int) -> int:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return min(divisors, key=lambda d: abs(d - target))
