"""Export a (sharded, any-layout) checkpoint to one safetensors file or a Hugging Face directory.

One parameter is assembled from its shards, converted and written before the next is read, so
memory is bounded by the largest tensor, not the model -- the failure mode of DeepSpeed's
``zero_to_fp32`` and Megatron's converters that users keep reporting.

The Hugging Face directory carries the tokenizer the checkpoint was trained with (the copy the
checkpoint holds, checked against its recorded SHA-256), because weights without it are unusable:
``AutoTokenizer`` would otherwise hand back a one-token GPT-2 vocabulary that encodes any text to
``[]``, and ``generate`` could not know where a document ends.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import torch

from zerotron.data.tokenizer import tokenizer_sha256
from zerotron.checkpoint.distributed import _Assembler
from zerotron.checkpoint.files import CheckpointError, ShardReader, read_metadata, resolve_load_path
from zerotron.checkpoint.export_hf_tokenizer import write_hf_tokenizer_dir
from zerotron.checkpoint.safetensors_stream import SafetensorsStreamWriter
from zerotron.zero.optimizer import DTYPES

WORD = "embedding.word.weight"


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"export dtype={name!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _open(checkpoint: str) -> tuple[dict, Path, _Assembler]:
    path, _ = resolve_load_path(checkpoint, field="checkpoint", otherwise="")  # convert_checkpoint.py's argument
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
        yield name, (t[:vocab] if name in VOCAB_ROWS else t)


VOCAB_ROWS = (WORD, "output_layer")  # the tables padded to the TP size (an untied output layer too)


def _shape_without_padding(name: str, shape: list[int], vocab: int) -> list[int]:
    return [vocab, *shape[1:]] if name in VOCAB_ROWS else list(shape)


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


def tokenizer_model(checkpoint: str, override: str | None = None) -> Path:
    """The tokenizer ``checkpoint`` was trained with (a sentencepiece model or a Hugging Face
    tokenizer directory): its own copy, verified.

    ``override`` serves checkpoints that predate the record; where a record exists it must match,
    since a different tokenizer would silently map every id to the wrong text.
    """
    meta, path, _ = _open(checkpoint)
    rec = meta.get("tokenizer")
    if override is not None:
        if not Path(override).exists():
            raise CheckpointError(f"--tokenizer {override}: no such file; give the sentencepiece .model "
                                  f"or the Hugging Face tokenizer directory the run used")
        if rec and tokenizer_sha256(override) != rec["sha256"]:
            raise CheckpointError(f"--tokenizer {override} is not the tokenizer {path} was trained with "
                                  f"({rec['path']}, SHA-256 {rec['sha256'][:12]}…); leave --tokenizer out to use "
                                  f"the checkpoint's own copy")
        return Path(override)
    if not rec:
        raise CheckpointError(f"{path} records no tokenizer (it predates checkpoints that keep theirs); pass the "
                              f"sentencepiece model the run was trained with: --tokenizer PATH")
    copy = path / rec["file"]
    if not copy.exists() or tokenizer_sha256(copy) != rec["sha256"]:
        raise CheckpointError(f"{copy} is missing or does not match the SHA-256 in metadata.json; pass the "
                              f"training tokenizer ({rec['path']}) with --tokenizer PATH")
    return copy


def _special_ids(model: Path) -> tuple[object, dict[str, int], dict[str, str]]:
    """The model proto, and the special tokens' ids and pieces: bos, eos (zerotron's end-of-document,
    appended after every training document) and pad, which is eos when the tokenizer has none
    (GPT-2's convention, so batched ``generate`` needs no extra token)."""
    from transformers.convert_slow_tokenizer import import_protobuf

    proto = import_protobuf().ModelProto()
    proto.ParseFromString(model.read_bytes())
    spec = proto.trainer_spec
    if spec.eos_id < 0:
        raise CheckpointError(f"tokenizer {model} has no end-of-document (eos) piece; generate could not stop")
    ids = {"eos": spec.eos_id, "pad": spec.pad_id if spec.pad_id >= 0 else spec.eos_id}
    if spec.bos_id >= 0:
        ids["bos"] = spec.bos_id
    if spec.unk_id >= 0:
        ids["unk"] = spec.unk_id
    pieces = {k: proto.pieces[i].piece for k, i in ids.items()}
    token_ids = {f"{k}_token_id": i for k, i in ids.items() if k != "unk"}
    return proto, token_ids, {f"{k}_token": p for k, p in pieces.items()}


def write_hf_tokenizer(model: Path, out: Path, max_length: int) -> dict[str, int]:
    """``tokenizer.json`` built by transformers' own SentencePiece converter, ``tokenizer_config.json``
    and the ``tokenizer.model`` itself; returns the special ids for ``config.json``.

    The converter follows the model's normalizer spec (identity, no dummy prefix, byte fallback),
    so the fast tokenizer gives SentencePiece's ids. ``split_special_tokens``: SentencePiece never
    reads ``</s>`` in text as the control token, and neither must the export, or text quoting it
    would encode differently than the training data did. One difference remains: zerotron encodes
    a literal U+2581 (SentencePiece's space marker) as its UTF-8 bytes, the converted tokenizer as
    a space; decoding zerotron's ids is exact either way.
    """
    from transformers import GenerationConfig, PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SpmConverter

    if model.is_dir():  # a Hugging Face tokenizer: its own files, as the run read them
        return write_hf_tokenizer_dir(model, out)
    proto, ids, pieces = _special_ids(model)
    scored = [(p.piece, p.score) for p in proto.pieces]
    vocab = scored if proto.trainer_spec.model_type == 1 else {piece: i for i, (piece, _) in enumerate(scored)}
    backend = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab)
    # left padding: a decoder-only model continues a batch of prompts from their last real token
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=max_length, split_special_tokens=True,
                                  padding_side="left", **pieces)
    tok.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # the name every transformers version resolves
    config_path.write_text(json.dumps(config, indent=1))
    shutil.copyfile(model, out / "tokenizer.model")  # for sentencepiece users (and zerotron's Tokenizer.load)
    GenerationConfig(**ids).save_pretrained(out)  # generate stops at the end-of-document id
    return ids


def _require_transformers() -> None:
    try:
        from transformers.convert_slow_tokenizer import SpmConverter
    except ImportError as exc:
        raise CheckpointError(f"the Hugging Face export needs transformers ({exc}); pip install 'transformers>=5'") \
            from None
    if not hasattr(SpmConverter, "build_tokenizer_from_spm_proto"):
        raise CheckpointError("the Hugging Face export needs transformers>=5 (its SentencePiece converter); "
                              "pip install -U 'transformers>=5'")


def saved_architecture(model_meta: dict) -> str:
    """The family a checkpoint's model metadata holds; a field it lacks (older checkpoints)
    is GPT-2's."""
    from zerotron.model.config import GPT2_ARCH
    return "gpt2" if all(model_meta.get(k, v) == v for k, v in GPT2_ARCH.items()) else "llama"


def write_tokenizer_files(checkpoint: str, out: Path, max_length: int,
                          override: str | None = None) -> dict[str, int]:
    """The one place an HF export writes its tokenizer files and ``generation_config.json``
    (today the checkpoint's SentencePiece model, converted); returns the special ids for
    ``config.json``."""
    return write_hf_tokenizer(tokenizer_model(checkpoint, override), out, max_length)


def export_hf_gpt2(checkpoint: str, out_dir: str, dtype: str = "fp32", tokenizer: str | None = None) -> Path:
    """A directory that ``GPT2LMHeadModel.from_pretrained`` (tied lm_head) and ``AutoTokenizer.from_pretrained``
    load, with ``generation_config.json``; ``tokenizer`` only for checkpoints that record none."""
    tokenizer_model(checkpoint, tokenizer)  # both fail before anything is written
    _require_transformers()
    meta, _, _ = _open(checkpoint)
    m, dt = meta["model"], _dtype(dtype)
    arch = saved_architecture(m)
    if arch != "gpt2":
        raise CheckpointError(f"{checkpoint} holds a {arch}-family model; export_hf_gpt2 writes "
                              f"GPT-2 only: use hf_export.export_hf, which picks the class")
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
    config.update(write_tokenizer_files(checkpoint, out, positions, tokenizer))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def write_consolidated(checkpoint: str, precision: str) -> Path:
    """``<checkpoint>/consolidated.safetensors``: the whole model in the run's working dtype (16-bit
    for fp16/bf16 runs, else fp32), what DeepSpeed's ``stage3_gather_16bit_weights_on_model_save``
    gives a user who wants one file to load; written by one rank after the checkpoint is complete."""
    dtype = precision if precision in ("fp16", "bf16") else "fp32"
    return export_safetensors(checkpoint, str(Path(checkpoint) / "consolidated.safetensors"), dtype)
