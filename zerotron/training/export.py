"""Export a (sharded, any-layout) checkpoint to one safetensors file or a Hugging Face GPT-2 directory.

One parameter is assembled from its shards, converted and written before the next is read, so
memory is bounded by the largest tensor, not the model -- the failure mode of DeepSpeed's
``zero_to_fp32`` and Megatron's converters that users keep reporting.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import torch

from zerotron.training.checkpoint import _Assembler
from zerotron.training.checkpoint_io import ShardReader, read_metadata, resolve_load_path
from zerotron.training.safetensors_stream import SafetensorsStreamWriter
from zerotron.zero.optimizer import DTYPES

WORD = "embedding.word.weight"


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"export dtype={name!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _open(checkpoint: str) -> tuple[dict, Path, _Assembler]:
    path, _ = resolve_load_path(checkpoint)
    meta = read_metadata(path)
    single = SimpleNamespace(tp_size=1, tp_rank=0)  # assemble full (unsharded) tensors
    return meta, path, _Assembler(meta, ShardReader(path, meta["files"]), single)


def full_tensors(checkpoint: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(canonical name, full fp32 tensor) for every parameter, one at a time; vocab padding removed."""
    meta, _, asm = _open(checkpoint)
    vocab = meta["model"]["vocab_size"]
    for name in sorted(meta["params"]):
        info = meta["params"][name]
        t = asm.local(name, "master", info["global_shape"], info["tp_split_dim"])
        yield name, (t[:vocab] if name == WORD else t)


def _shape_without_padding(name: str, shape: list[int], vocab: int) -> list[int]:
    return [vocab, *shape[1:]] if name == WORD else list(shape)


def export_safetensors(checkpoint: str, out: str, dtype: str = "fp32") -> Path:
    """All parameters under their canonical names in one safetensors file."""
    meta, _, _ = _open(checkpoint)
    vocab, dt = meta["model"]["vocab_size"], _dtype(dtype)
    specs = [(n, _shape_without_padding(n, meta["params"][n]["global_shape"], vocab), dt) for n in sorted(meta["params"])]
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with SafetensorsStreamWriter(out_path, specs, metadata={"format": "pt", "step": meta["step"]}) as w:
        for name, t in full_tensors(checkpoint):
            w.write(name, t.to(dt))
    return out_path


def _hf_name_and_fn(name: str, heads: int):
    """Our canonical name -> (HF GPT-2 name, conversion); HF uses Conv1D (weights transposed)."""
    if name == WORD:
        return "transformer.wte.weight", lambda t: t
    if name == "embedding.position":
        return "transformer.wpe.weight", lambda t: t
    if name.startswith("final_ln."):
        return "transformer.ln_f." + name.split(".")[-1], lambda t: t
    _, layer, rest = name.split(".", 2)
    prefix = f"transformer.h.{layer}."

    def qkv(t: torch.Tensor) -> torch.Tensor:  # rows (head, {q,k,v}, d) -> columns (q|k|v, head, d)
        three_h = t.shape[0]
        d = three_h // (3 * heads)
        if t.ndim == 1:
            return t.view(heads, 3, d).permute(1, 0, 2).reshape(three_h)
        return t.view(heads, 3, d, -1).permute(1, 0, 2, 3).reshape(three_h, -1).t()

    def transpose(t: torch.Tensor) -> torch.Tensor:
        return t.t() if t.ndim == 2 else t

    table = {"ln1": ("ln_1", None), "ln2": ("ln_2", None), "attn.qkv": ("attn.c_attn", qkv),
             "attn.proj": ("attn.c_proj", transpose), "mlp.fc1": ("mlp.c_fc", transpose),
             "mlp.fc2": ("mlp.c_proj", transpose)}
    module, leaf = rest.rsplit(".", 1)
    hf_module, fn = table[module]
    return prefix + hf_module + "." + leaf, fn or (lambda t: t)


def export_hf_gpt2(checkpoint: str, out_dir: str, dtype: str = "fp32") -> Path:
    """A directory that ``transformers.GPT2LMHeadModel.from_pretrained`` loads (tied lm_head)."""
    meta, _, _ = _open(checkpoint)
    m, dt = meta["model"], _dtype(dtype)
    heads, vocab = m["num_heads"], m["vocab_size"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = sorted(meta["params"])
    specs = []
    for n in names:
        hf, fn = _hf_name_and_fn(n, heads)
        shape = _shape_without_padding(n, meta["params"][n]["global_shape"], vocab)
        specs.append((hf, list(fn(torch.empty(shape, device="meta")).shape), dt))
    with SafetensorsStreamWriter(out / "model.safetensors", specs, metadata={"format": "pt"}) as w:
        for n, t in full_tensors(checkpoint):
            hf, fn = _hf_name_and_fn(n, heads)  # same (sorted) order as the header
            w.write(hf, fn(t).contiguous().to(dt))
    positions = meta["params"]["embedding.position"]["global_shape"][0]
    ffn = meta["params"]["layers.0.mlp.fc1.weight"]["global_shape"][0]
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab,
              "n_positions": positions, "n_embd": m["hidden_size"], "n_layer": m["num_layers"], "n_head": heads,
              "n_inner": ffn, "activation_function": "gelu" if m.get("gelu_approximate") == "none" else "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0,
              "attn_pdrop": 0.0, "layer_norm_epsilon": m.get("layernorm_eps", 1e-5),
              "tie_word_embeddings": True, "torch_dtype": str(dt).removeprefix("torch.")}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out
