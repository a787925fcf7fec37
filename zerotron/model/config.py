"""GPT configuration: the model's shape, validated once against the tensor-parallel size.

The default architecture is GPT-2's (the family both the ZeRO paper §10.1 and Megatron-LM §5
train): learned positions, pre-LayerNorm blocks, a 4h GeLU MLP, tied input/output embeddings.
The architecture fields, named as Megatron-core's ``TransformerConfig`` names them, select the
Llama family instead (RoPE, RMSNorm, SwiGLU, grouped-query attention, untied output layer);
``architecture`` names which of the two a config holds (checkpoints record it).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

# The choices of the architecture fields, declared once as their types: validate() and the run
# config's --help, choice checks and CLI coercion (zerotron/config/fields.py) all read them.
GeluForm = Literal["tanh", "none"]
PositionEmbedding = Literal["learned", "rope"]
Normalization = Literal["LayerNorm", "RMSNorm"]
Activation = Literal["gelu", "swiglu"]


@dataclass
class GPTConfig:
    """Shape and regularisation of a GPT-2-style model.

    ``dropout`` is the hidden/residual (and embedding) dropout, applied outside TP regions;
    ``attention_dropout`` drops attention probabilities inside the TP region (per-rank stream).
    ``paper_mp`` records the model-parallel degree the source paper used for this shape. The
    docstring under each field is its one line of ``--help`` (``zerotron.config.fields``).
    """

    num_layers: int
    """transformer blocks"""
    hidden_size: int
    """hidden size h"""
    num_heads: int
    """attention heads (divisible by parallel.tp)"""
    vocab_size: int
    """vocabulary; null: the tokenizer's (padded at run time for TP)"""
    seq_length: int
    """tokens per sample"""
    dropout: float = 0.0
    """hidden/residual and embedding dropout"""
    attention_dropout: float = 0.0
    """dropout on attention probabilities"""
    make_vocab_size_divisible_by: int = 128
    """pad the vocabulary to a multiple of this x tp (Megatron: 128)"""
    init_std: float = 0.02
    """std of the normal weight init (GPT-2: 0.02)"""
    layernorm_eps: float = 1e-5
    """LayerNorm epsilon"""
    ffn_hidden_size: int | None = None
    """MLP width; null: 4 x hidden_size"""
    max_position_embeddings: int | None = None
    """position table size; null: seq_length"""
    gelu_approximate: GeluForm = "tanh"
    """GeLU form: tanh (GPT-2's gelu_new) or none (erf)"""
    # architecture (Megatron-core TransformerConfig names); the defaults are GPT-2's
    position_embedding_type: PositionEmbedding = "learned"
    """learned (GPT-2's table) or rope (rotary, the Llama family)"""
    rotary_base: float = 10000.0
    """RoPE's theta (Llama-3: 500000; Qwen2.5, Mistral: 1e6)"""
    rope_scaling: bool = False
    """Llama-3.1's RoPE frequency scaling, with the rope_scaling_* fields"""
    rope_scaling_factor: float = 8.0
    """how much long wavelengths are stretched (Llama-3.1: 8, 3.2: 32)"""
    rope_scaling_low_freq_factor: float = 1.0
    """Llama-3.1's low-frequency factor (1)"""
    rope_scaling_high_freq_factor: float = 4.0
    """Llama-3.1's high-frequency factor (4)"""
    rope_scaling_original_max_position_embeddings: int = 8192
    """the context RoPE was trained at (8192)"""
    normalization: Normalization = "LayerNorm"
    """LayerNorm (GPT-2) or RMSNorm (Llama); epsilon: layernorm_eps"""
    activation: Activation = "gelu"
    """gelu, or swiglu: down(silu(gate(x)) * up(x)) of width ffn_hidden_size"""
    num_query_groups: int | None = None
    """K/V heads of grouped-query attention (divisible by tp); null: num_heads"""
    add_bias_linear: bool = True
    """biases in every linear layer (GPT-2: true, Llama: false)"""
    add_qkv_bias: bool = False
    """q/k/v biases when add_bias_linear is false (Qwen2)"""
    untie_embeddings_and_output_weights: bool = False
    """the output layer its own weight, vocab-parallel"""
    qk_layernorm: bool = False
    """normalise each head's q and k before RoPE (Qwen3)"""
    # document masking of packed samples (Megatron's names): attention and positions per document
    reset_attention_mask: bool = False
    """document masking: attention never crosses an end-of-document token"""
    reset_position_ids: bool = False
    """positions restart after each end-of-document token"""
    eod_token_id: int | None = None
    """end-of-document token for document masking; null: the tokenizer's"""
    paper_mp: int = 1
    """the model-parallel degree the source paper used for this shape (a preset's label)"""
    name: str = ""
    """the preset's name (a label, not a shape choice)"""

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings if self.max_position_embeddings is not None else self.seq_length

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def query_groups(self) -> int:
        """K/V heads: ``num_query_groups``, or one per query head (multi-head attention)."""
        return self.num_heads if self.num_query_groups is None else self.num_query_groups

    @property
    def kv_size(self) -> int:
        """Width of K (and of V): query_groups · head_dim, ``hidden_size`` without GQA."""
        return self.query_groups * self.head_dim

    @property
    def gated(self) -> bool:
        """SwiGLU: the first MLP GEMM makes gate and up rows, 2·ffn outputs."""
        return self.activation == "swiglu"

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def tied(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    @property
    def document_masking(self) -> bool:
        return self.reset_attention_mask or self.reset_position_ids

    @property
    def architecture(self) -> str:
        """``gpt2`` for the defaults, else ``llama``: the family a checkpoint says it holds."""
        return "gpt2" if self.arch_fields() == GPT2_ARCH else "llama"

    def arch_fields(self) -> dict:
        """The fields that change which weights a model has or what it computes with them."""
        return {f: getattr(self, f) for f in GPT2_ARCH}

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
        if self.gelu_approximate not in typing.get_args(GeluForm):
            forms = " or ".join(map(repr, typing.get_args(GeluForm)))
            raise ValueError(f"model.gelu_approximate={self.gelu_approximate!r}: use {forms}")
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
        self._validate_architecture(tp)
        if self.ffn_size % tp:
            raise ValueError(f"model.ffn_hidden_size={self.ffn_size} is not divisible by parallel.tp={tp}; "
                             f"use a tp that divides it")
        learned = self.position_embedding_type == "learned"
        if learned and self.max_positions < self.seq_length:
            raise ValueError(f"model.seq_length={self.seq_length} exceeds the position table "
                             f"(model.max_position_embeddings={self.max_positions}); raise "
                             f"model.max_position_embeddings to >= {self.seq_length} or shorten model.seq_length")
        return self

    def num_params(self, tp: int = 1) -> int:
        """Parameter count by [N21] Eq. 2: P = 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h)).

        V is the padded vocabulary at ``tp`` and s the position table. Equals 12lh² + 13lh +
        (V+s)h, i.e. every parameter except the final LayerNorm's 2h (see ``exact_num_params``).
        Other architectures (the formula is GPT-2's): ``exact_num_params``.
        """
        if self.architecture != "gpt2":
            return self.exact_num_params(tp)
        l, h, s, v = self.num_layers, self.hidden_size, self.max_positions, self.padded_vocab_size(tp)
        return 12 * l * h * h + 13 * l * h + (v + s) * h  # the formula, expanded to stay exact

    def exact_num_params(self, tp: int = 1) -> int:
        """Every parameter of ``GPT`` (a tied embedding counted once), summed over TP ranks."""
        l, h, f, kv = self.num_layers, self.hidden_size, self.ffn_size, self.kv_size
        fc1 = 2 * f if self.gated else f
        bias = self.add_bias_linear
        attn = (h + 2 * kv) * h + (h + 2 * kv) * self.qkv_bias + h * h + h * bias
        mlp = h * fc1 + fc1 * bias + f * h + h * bias
        norm = h if self.normalization == "RMSNorm" else 2 * h  # RMSNorm has no bias
        qk_norm = 2 * (norm // h) * self.head_dim if self.qk_layernorm else 0
        learned = self.position_embedding_type == "learned"
        positions = self.max_positions * h if learned else 0
        head = self.padded_vocab_size(tp) * h if not self.tied else 0
        vocab = self.padded_vocab_size(tp) * h
        return l * (attn + mlp + 2 * norm + qk_norm) + vocab + positions + head + norm

    def _validate_architecture(self, tp: int) -> None:
        """The architecture fields (Megatron-core's names); errors name the field and the fix."""
        for field, allowed in ARCH_CHOICES.items():
            if getattr(self, field) not in allowed:
                raise ValueError(f"model.{field}={getattr(self, field)!r}: use one of "
                                 f"{', '.join(allowed)}")
        for field in ARCH_BOOLS:
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"model.{field}={getattr(self, field)!r}: give true or false")
        for field in ARCH_POSITIVE:
            if getattr(self, field) <= 0:
                raise ValueError(f"model.{field}={getattr(self, field)}: must be > 0")
        low, high = self.rope_scaling_low_freq_factor, self.rope_scaling_high_freq_factor
        if self.rope_scaling and high <= low:
            raise ValueError(f"model.rope_scaling_high_freq_factor={high} must exceed "
                             f"model.rope_scaling_low_freq_factor={low} (Llama-3.1: 4 and 1)")
        if self.reset_attention_mask and self.attention_dropout > 0:
            raise ValueError(f"model.attention_dropout={self.attention_dropout} with "
                             f"model.reset_attention_mask: the document-masked attention kernel "
                             f"has no dropout; set attention_dropout to 0")
        g, nh = self.query_groups, self.num_heads
        if not isinstance(g, int) or isinstance(g, bool) or g < 1 or nh % g:
            raise ValueError(f"model.num_query_groups={g!r}: must be a positive integer dividing "
                             f"model.num_heads={nh} (1: multi-query; null: one group per head)")
        if g % tp:
            raise ValueError(f"model.num_query_groups={g} is not divisible by parallel.tp={tp}: "
                             f"each TP rank holds whole query groups (their K/V heads); use a tp "
                             f"that divides {g} or change num_query_groups")
        if self.position_embedding_type == "rope" and self.head_dim % 2:
            raise ValueError(f"model.hidden_size/model.num_heads={self.head_dim}: RoPE rotates "
                             f"pairs of a head's dimensions, so the head dimension must be even; "
                             f"change num_heads or hidden_size")


ARCH_CHOICES = {name: typing.get_args(kind) for name, kind in (
    ("position_embedding_type", PositionEmbedding), ("normalization", Normalization),
    ("activation", Activation))}  # read from the fields' Literal types
ARCH_BOOLS = ("add_bias_linear", "add_qkv_bias", "untie_embeddings_and_output_weights",
              "qk_layernorm", "rope_scaling", "reset_attention_mask", "reset_position_ids")
ARCH_POSITIVE = ("rotary_base", "rope_scaling_factor", "rope_scaling_low_freq_factor",
                 "rope_scaling_high_freq_factor", "rope_scaling_original_max_position_embeddings")
GPT2_ARCH = {"position_embedding_type": "learned", "rotary_base": 10000.0, "rope_scaling": False,
             "rope_scaling_factor": 8.0, "rope_scaling_low_freq_factor": 1.0,
             "rope_scaling_high_freq_factor": 4.0,
             "rope_scaling_original_max_position_embeddings": 8192, "normalization": "LayerNorm",
             "activation": "gelu", "num_query_groups": None, "add_bias_linear": True,
             "add_qkv_bias": False, "untie_embeddings_and_output_weights": False,
             "qk_layernorm": False}
"""GPT-2's value of every architecture field (``GPTConfig.arch_fields``)."""


def _divisor_near(n: int, target: int) -> int:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return min(divisors, key=lambda d: abs(d - target))
