"""A Llama-family checkpoint as the transformers class it came from: Llama, Mistral or Qwen2.

Streamed as the GPT-2 export is (``export.py``): one parameter assembled from its shards (any
TP / PP / DP / ZeRO layout), cut into its HF tensors and written before the next is read. The
inverse of ``hf_weights``: q/k/v rows grouped per query group go back to ``q_proj``, ``k_proj``,
``v_proj``; SwiGLU's alternated rows to ``gate_proj`` and ``up_proj``. The class is the one the
checkpoint records (``hf_model_type``, set by ``--init-from-hf``), else Qwen2 for q/k/v biases
and Llama otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from zerotron.checkpoint.files import CheckpointError
from zerotron.checkpoint.export import (_dtype, _open, _require_transformers, _shape_without_padding,
                                      export_hf_gpt2, full_tensors, saved_architecture,
                                      tokenizer_model, write_tokenizer_files)
from zerotron.checkpoint.safetensors_stream import SafetensorsStreamWriter

CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
           "qwen2": "Qwen2ForCausalLM"}


def family_of(m: dict, checkpoint: str) -> str:
    """The class to write; refuses what none of the three computes."""
    family = m.get("hf_model_type") or ("qwen2" if m.get("add_qkv_bias") else "llama")
    needs = {"position_embedding_type": "rope", "normalization": "RMSNorm",
             "activation": "swiglu", "add_bias_linear": False, "qk_layernorm": False,
             "add_qkv_bias": family == "qwen2"}
    differ = [f"model.{k}={m.get(k)!r}" for k, v in needs.items() if m.get(k) != v]
    if family not in CLASSES or differ:
        raise CheckpointError(f"{checkpoint}: {', '.join(differ) or family} has no transformers "
                              f"class here; the export writes {', '.join(CLASSES.values())} and "
                              f"GPT2LMHeadModel: use --safetensors for zerotron's own names")
    return family


def hf_tensors(name: str, m: dict) -> list[tuple[str, object]]:
    """zerotron's ``name`` -> [(HF name, function of the full tensor)]."""
    if name == "embedding.word.weight":
        return [("model.embed_tokens.weight", lambda t: t)]
    if name == "output_layer":
        return [("lm_head.weight", lambda t: t)]
    if name == "final_ln.weight":
        return [("model.norm.weight", lambda t: t)]
    _, layer, rest = name.split(".", 2)
    p = f"model.layers.{layer}."
    heads, hidden = m["num_heads"], m["hidden_size"]
    groups, d = m.get("num_query_groups") or heads, hidden // heads
    rep = heads // groups

    def part(lo: int, hi: int):  # rows [lo, hi) of every query group's block
        def cut(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(groups, (rep + 2) * d, *t.shape[1:])[:, lo * d:hi * d] \
                .reshape(-1, *t.shape[1:])
        return cut

    simple = {"ln1.weight": "input_layernorm.weight",
              "ln2.weight": "post_attention_layernorm.weight",
              "attn.proj.weight": "self_attn.o_proj.weight",
              "mlp.fc2.weight": "mlp.down_proj.weight"}
    if rest in simple:
        return [(p + simple[rest], lambda t: t)]
    if rest.startswith("attn.qkv."):
        kind = rest.rsplit(".", 1)[1]
        return [(f"{p}self_attn.q_proj.{kind}", part(0, rep)),
                (f"{p}self_attn.k_proj.{kind}", part(rep, rep + 1)),
                (f"{p}self_attn.v_proj.{kind}", part(rep + 1, rep + 2))]
    if rest == "mlp.fc1.weight":  # rows gate_0, up_0, gate_1, ...
        return [(p + "mlp.gate_proj.weight", lambda t: t.view(-1, 2, t.shape[1])[:, 0]),
                (p + "mlp.up_proj.weight", lambda t: t.view(-1, 2, t.shape[1])[:, 1])]
    raise CheckpointError(f"parameter {name} has no place in a Llama-family transformers model")


def hf_config(m: dict, family: str, positions: int, dt: torch.dtype) -> dict:
    """``config.json`` for ``family`` with the checkpoint's architecture."""
    heads, hidden = m["num_heads"], m["hidden_size"]
    rope = {"rope_type": "default", "rope_theta": m.get("rotary_base", 10000.0)}
    if m.get("rope_scaling"):
        rope.update(rope_type="llama3", factor=m["rope_scaling_factor"],
                    low_freq_factor=m["rope_scaling_low_freq_factor"],
                    high_freq_factor=m["rope_scaling_high_freq_factor"],
                    original_max_position_embeddings=m[
                        "rope_scaling_original_max_position_embeddings"])
    config = {"architectures": [CLASSES[family]], "model_type": family,
              "vocab_size": m["vocab_size"], "hidden_size": hidden,
              "intermediate_size": m.get("ffn_hidden_size") or 4 * hidden,
              "num_hidden_layers": m["num_layers"], "num_attention_heads": heads,
              "num_key_value_heads": m.get("num_query_groups") or heads,
              "head_dim": hidden // heads,
              "max_position_embeddings": positions, "rms_norm_eps": m.get("layernorm_eps", 1e-5),
              "hidden_act": "silu", "attention_dropout": 0.0, "rope_parameters": rope,
              "tie_word_embeddings": not m.get("untie_embeddings_and_output_weights", False),
              "dtype": str(dt).removeprefix("torch.")}
    if family == "llama":
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:  # full causal attention: no sliding window
        config.update(sliding_window=None, use_sliding_window=False)
    return config


def export_hf_llama(checkpoint: str, out_dir: str, dtype: str = "fp32",
                    tokenizer: str | None = None) -> Path:
    """``out_dir``: model.safetensors, config.json for the family's class, the tokenizer files."""
    tokenizer_model(checkpoint, tokenizer)  # fails before anything is written
    _require_transformers()
    meta, _, _ = _open(checkpoint)
    m, dt = meta["model"], _dtype(dtype)
    family = family_of(m, checkpoint)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specs = []
    for n in sorted(meta["params"]):
        shape = _shape_without_padding(n, meta["params"][n]["global_shape"], m["vocab_size"])
        for hf, fn in hf_tensors(n, m):
            specs.append((hf, list(fn(torch.empty(shape, device="meta")).shape), dt))
    with SafetensorsStreamWriter(out / "model.safetensors", specs, metadata={"format": "pt"}) as w:
        for n, t in full_tensors(checkpoint):  # same (sorted) order as the header
            for hf, fn in hf_tensors(n, m):
                w.write(hf, fn(t).contiguous().to(dt))
    positions = m.get("max_position_embeddings") or m["seq_length"]
    config = hf_config(m, family, positions, dt)
    config.update(write_tokenizer_files(checkpoint, out, positions, tokenizer))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def export_hf(checkpoint: str, out_dir: str, dtype: str = "fp32",
              tokenizer: str | None = None) -> Path:
    """The transformers class of the checkpoint's family: GPT-2, or Llama / Mistral / Qwen2."""
    meta, _, _ = _open(checkpoint)
    if saved_architecture(meta["model"]) == "gpt2":
        return export_hf_gpt2(checkpoint, out_dir, dtype, tokenizer)
    return export_hf_llama(checkpoint, out_dir, dtype, tokenizer)
