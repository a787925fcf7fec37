"""What ``scripts/generate.py`` builds: the model of a zerotron checkpoint in this TP layout,
its tokenizer, and the prompt's ids.

Why from the checkpoint's fp32 masters: they are the weights the run trained (a 16-bit run's
working copy is their rounding), saved in any TP x PP x DP layout and resharded here by the
loader the trainer uses (``distributed._Assembler``), so a checkpoint written at TP 2 x PP 2
generates at TP 1 or TP 4 alike. A transformers directory is read by ``--init-from-hf``'s plan
(``hf_weights``, ``hf_import``): each rank reads only its rows of the safetensors files.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from zerotron.model.config import GPTConfig
from zerotron.model.gpt import GPT
from zerotron.parallel.shard_info import set_shard_info, shard_info
from zerotron.checkpoint.distributed import _Assembler, canonical_names, check_shape
from zerotron.checkpoint.files import (CheckpointError, ShardReader, read_metadata,
                                             resolve_load_path)

# generation reads one document: packed-document masking has nothing to separate
_ONE_DOCUMENT = dict(reset_attention_mask=False, reset_position_ids=False, dropout=0.0,
                     attention_dropout=0.0)


def checkpoint_config(meta: dict) -> GPTConfig:
    """The ``GPTConfig`` a checkpoint's ``metadata.json`` records (its ``architecture`` label is
    derived from the fields, not one)."""
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    values = {k: v for k, v in meta["model"].items() if k in fields}
    return GPTConfig(**{**values, **{k: v for k, v in _ONE_DOCUMENT.items() if k in fields}})


def open_checkpoint(load: str) -> tuple[Path, dict, GPTConfig]:
    """The checkpoint's directory, metadata and model config; errors name ``--load``."""
    path, _ = resolve_load_path(load, field="--load", otherwise="")
    meta = read_metadata(path)
    if not meta.get("model"):
        raise CheckpointError(f"--load {path}: its metadata.json records no model config (a "
                              f"library save without one); generate needs the model's shape")
    try:
        return path, meta, checkpoint_config(meta)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"--load {path}: its model config does not build ({e})") from None


def model_from_checkpoint(path: Path, meta: dict, cfg: GPTConfig, grid, device) -> GPT:
    """This TP rank's slice of every weight, read from the checkpoint's masters; eval mode."""
    assembler = _Assembler(meta, ShardReader(path, meta["files"]), grid, torch.float32)

    def local(canon: str, info, shape: list[int]) -> torch.Tensor:
        check_shape(canon, meta["params"][canon]["global_shape"], list(info.global_shape))
        return assembler.local(canon, "master", shape, info.tp_split_dim)

    return _filled(cfg, grid, device, local)


def _filled(cfg: GPTConfig, grid, device, local) -> GPT:
    """The model built on the meta device, then each parameter made on ``device`` and filled by
    ``local(canonical name, its ShardInfo, TP-local shape)``: no random initialisation of
    weights overwritten at once."""
    model = GPT(cfg, grid, dtype=torch.float32, device="meta")
    infos = {name: shard_info(p, name) for name, p in model.named_parameters()}
    model.to_empty(device=device)  # new parameters: their ShardInfo attached again below
    names = canonical_names(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            set_shard_info(p, infos[name])
            p.copy_(local(names[name], infos[name], list(p.shape)).view(p.shape))
    return model.eval()


def hf_config(directory: str, tokens: int) -> tuple[GPTConfig, str]:
    """The ``GPTConfig`` of a transformers model directory (``hf_config.read_hf_config``, which
    refuses what we do not build) for ``tokens`` positions, and its family."""
    from zerotron.config.hf_config import read_hf_config

    hf = read_hf_config(directory, seq_length=tokens)
    fields = {**hf.fields, **_ONE_DOCUMENT}
    return GPTConfig(**fields, seq_length=fields["max_position_embeddings"]), hf.model_type


def hf_tensors(directory: str, cfg: GPTConfig, family: str):
    """The directory's safetensors, every tensor the model needs checked (presence, shape, a
    floating dtype) before any process group: a bad file is refused on every rank."""
    from zerotron.checkpoint.hf_import import HFTensors
    from zerotron.checkpoint.hf_weights import expected_tensors

    reader = HFTensors(directory)
    reader.check(expected_tensors(cfg, family))
    return reader


def model_from_hf(reader, cfg: GPTConfig, family: str, grid, device) -> GPT:
    """This TP rank's slice of every weight, read from the checked safetensors by the
    importer's plan (``hf_weights.pieces``: only this rank's rows); eval mode."""
    from zerotron.checkpoint.hf_import import fill_range
    from zerotron.checkpoint.hf_weights import pieces

    def local(canon: str, info, shape: list[int]) -> torch.Tensor:
        plan = pieces(canon, cfg, family, grid.tp_size, grid.tp_rank)
        out = torch.empty(math.prod(shape), dtype=torch.float32)
        return fill_range(reader, plan, shape, 0, out.numel(), out)

    model = _filled(cfg, grid, device, local)
    reader.close()  # the files' mapped pages go back
    return model


def kept_tokenizer(path: Path) -> str | None:
    """The checkpoint's own copy of its run's tokenizer (verified), or None if it keeps none."""
    from zerotron.checkpoint.export import tokenizer_model

    if not read_metadata(path).get("tokenizer"):
        return None
    return str(tokenizer_model(str(path)))


def prompt_from_text(tokenizer_path: str, text: str) -> list[int]:
    """The ids a document starting with ``text`` begins with in the token files: an HF
    tokenizer's bos (where it has one), then the text's ids."""
    from zerotron.data.tokenizer import Tokenizer

    tok = Tokenizer.load(tokenizer_path)
    return ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(text)
