"""Where each row of a zerotron parameter lives in a Hugging Face checkpoint.

A TP rank's slice of a parameter is a list of ``Piece``s, each a run of rows of one HF tensor (or
of two, alternated: SwiGLU's gate and up). The import reads exactly those rows -- and of them only
the ones its ZeRO partition holds -- with safetensors' ``get_slice``, so no rank ever holds the
whole model (torchtitan #1466's start-up load, without its full-model read per rank).

zerotron's layouts (``model/block.py``): q/k/v rows grouped per query group (the group's query
heads, then its k head, then its v head), so a TP split keeps whole groups; SwiGLU's first GEMM
rows alternate gate and up; the vocabulary tables padded to ``padded_vocab_size(tp)``. GPT-2's
Conv1D weights are stored transposed, so their rows are the HF tensor's columns.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerotron.model.config import GPTConfig


@dataclass(frozen=True)
class Piece:
    """Rows ``rows`` of HF tensor ``hf`` (its columns when ``transposed``), restricted to ``cols``
    of the other dimension; ``interleave``: a second tensor whose rows alternate with ``hf``'s;
    ``hf`` None: zero rows (the vocabulary's padding)."""

    hf: str | None
    rows: tuple[int, int]
    cols: tuple[int, int] | None = None
    transposed: bool = False
    interleave: str | None = None

    @property
    def length(self) -> int:
        return (self.rows[1] - self.rows[0]) * (2 if self.interleave else 1)


def _block(n: int, tp: int, rank: int) -> tuple[int, int]:
    return n // tp * rank, n // tp * (rank + 1)


def _vocab_pieces(hf: str, cfg: GPTConfig, tp: int, rank: int) -> list[Piece]:
    a, b = _block(cfg.padded_vocab_size(tp), tp, rank)
    real = (a, min(b, cfg.vocab_size))
    out = [Piece(hf, real)] if real[1] > real[0] else []
    pad = b - max(a, cfg.vocab_size)
    return out + ([Piece(None, (0, pad))] if pad > 0 else [])


def _llama_layer(rest: str, p: str, cfg: GPTConfig, tp: int, rank: int) -> list[Piece]:
    h, d, f = cfg.hidden_size, cfg.head_dim, cfg.ffn_size
    rep = cfg.num_heads // cfg.query_groups
    if rest in ("ln1.weight", "ln2.weight"):
        norm = "input_layernorm" if rest == "ln1.weight" else "post_attention_layernorm"
        return [Piece(f"{p}{norm}.weight", (0, h))]
    if rest.startswith("attn.qkv."):
        kind = rest.rsplit(".", 1)[1]
        out = []
        for g in range(*_block(cfg.query_groups, tp, rank)):  # whole groups per TP rank
            out += [Piece(f"{p}self_attn.q_proj.{kind}", (g * rep * d, (g + 1) * rep * d)),
                    Piece(f"{p}self_attn.k_proj.{kind}", (g * d, (g + 1) * d)),
                    Piece(f"{p}self_attn.v_proj.{kind}", (g * d, (g + 1) * d))]
        return out
    if rest == "attn.proj.weight":
        return [Piece(f"{p}self_attn.o_proj.weight", (0, h), _block(h, tp, rank))]
    if rest == "mlp.fc1.weight":  # rows gate_0, up_0, gate_1, ...
        return [Piece(f"{p}mlp.gate_proj.weight", _block(f, tp, rank),
                      interleave=f"{p}mlp.up_proj.weight")]
    if rest == "mlp.fc2.weight":
        return [Piece(f"{p}mlp.down_proj.weight", (0, h), _block(f, tp, rank))]
    raise KeyError(rest)


def _gpt2_layer(rest: str, p: str, cfg: GPTConfig, tp: int, rank: int) -> list[Piece]:
    h, d, f = cfg.hidden_size, cfg.head_dim, cfg.ffn_size
    module, leaf = rest.rsplit(".", 1)
    if module in ("ln1", "ln2"):
        return [Piece(f"{p}{'ln_1' if module == 'ln1' else 'ln_2'}.{leaf}", (0, h))]
    if module == "attn.qkv":  # HF columns q | k | v, each head-major; ours per head (q, k, v)
        out = []
        for head in range(*_block(cfg.num_heads, tp, rank)):
            out += [Piece(f"{p}attn.c_attn.{leaf}", (j * h + head * d, j * h + (head + 1) * d),
                          transposed=leaf == "weight") for j in range(3)]
        return out
    if module in ("attn.proj", "mlp.fc2"):  # split along the input, HF's rows
        hf = f"{p}{'attn' if module == 'attn.proj' else 'mlp'}.c_proj.{leaf}"
        if leaf == "bias":
            return [Piece(hf, (0, h))]
        return [Piece(hf, (0, h), _block(h if module == "attn.proj" else f, tp, rank), True)]
    if module == "mlp.fc1":
        return [Piece(f"{p}mlp.c_fc.{leaf}", _block(f, tp, rank), transposed=leaf == "weight")]
    raise KeyError(rest)


def pieces(canon: str, cfg: GPTConfig, family: str, tp: int, rank: int) -> list[Piece]:
    """TP rank ``rank``'s slice of zerotron's parameter ``canon``, row by row, as HF pieces."""
    gpt2 = family == "gpt2"
    if canon == "embedding.word.weight":
        return _vocab_pieces("transformer.wte.weight" if gpt2 else "model.embed_tokens.weight",
                             cfg, tp, rank)
    if canon == "output_layer":
        return _vocab_pieces("lm_head.weight", cfg, tp, rank)
    if canon == "embedding.position":
        return [Piece("transformer.wpe.weight", (0, cfg.max_positions))]
    if canon.startswith("final_ln."):
        leaf = canon.split(".")[1]
        return [Piece(f"transformer.ln_f.{leaf}" if gpt2 else "model.norm.weight",
                      (0, cfg.hidden_size))]
    _, layer, rest = canon.split(".", 2)
    if gpt2:
        return _gpt2_layer(rest, f"transformer.h.{layer}.", cfg, tp, rank)
    return _llama_layer(rest, f"model.layers.{layer}.", cfg, tp, rank)


def expected_tensors(cfg: GPTConfig, family: str) -> dict[str, list[int]]:
    """Every tensor a model directory of ``family`` with ``cfg``'s shape holds, and its shape."""
    h, f, v, kv = cfg.hidden_size, cfg.ffn_size, cfg.vocab_size, cfg.kv_size
    if family == "gpt2":
        out = {"transformer.wte.weight": [v, h], "transformer.wpe.weight": [cfg.max_positions, h],
               "transformer.ln_f.weight": [h], "transformer.ln_f.bias": [h]}
        for i in range(cfg.num_layers):
            p = f"transformer.h.{i}."
            out.update({p + "ln_1.weight": [h], p + "ln_1.bias": [h], p + "ln_2.weight": [h],
                        p + "ln_2.bias": [h], p + "attn.c_attn.weight": [h, 3 * h],
                        p + "attn.c_attn.bias": [3 * h], p + "attn.c_proj.weight": [h, h],
                        p + "attn.c_proj.bias": [h], p + "mlp.c_fc.weight": [h, f],
                        p + "mlp.c_fc.bias": [f], p + "mlp.c_proj.weight": [f, h],
                        p + "mlp.c_proj.bias": [h]})
        return out
    out = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h]}
    if cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = [v, h]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h],
                    p + "self_attn.q_proj.weight": [h, h], p + "self_attn.k_proj.weight": [kv, h],
                    p + "self_attn.v_proj.weight": [kv, h], p + "self_attn.o_proj.weight": [h, h],
                    p + "mlp.gate_proj.weight": [f, h], p + "mlp.up_proj.weight": [f, h],
                    p + "mlp.down_proj.weight": [h, f]})
        if cfg.add_qkv_bias:
            out.update({p + "self_attn.q_proj.bias": [h], p + "self_attn.k_proj.bias": [kv],
                        p + "self_attn.v_proj.bias": [kv]})
    return out


# buffers some checkpoints carry beside the weights; never parameters of the model
BUFFERS = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
