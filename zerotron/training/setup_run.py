"""Build what a run needs from its validated config: grid, tokenizer, data, model, optimizer.

Kept apart from the loop so tests and benchmarks can build the same pieces. Everything that can
fail on bad input (config, tokenizer, token files) fails here, on every rank, before the first
training collective.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from zerotron.parallel import Grid, ParallelDims
from zerotron.parallel import collectives as C
from zerotron.training.config import ConfigError, RunConfig

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class DataBundle:
    train_prefixes: list[str]
    train_weights: list[float] | None
    eval_prefixes: list[str]
    tokenizer_path: str | None
    vocab_size: int


def prepare_data(cfg: RunConfig, grid: Grid) -> DataBundle:
    """Token files and tokenizer: the built-in corpus (rank 0 builds, the others wait) or the user's."""
    from zerotron.data import IndexedTokenDataset, Tokenizer, build_default_corpus

    d = cfg.data
    if not d.data_path:
        if grid.rank == 0:
            build_default_corpus(d.cache_dir, vocab_size=d.default_corpus_vocab)
        C.barrier(grid.world_group)
        train, tok_path, evals = build_default_corpus(d.cache_dir, vocab_size=d.default_corpus_vocab)
        bundle = DataBundle([train], None, [evals], tok_path, 0)
    else:
        bundle = DataBundle(list(d.data_path), list(d.data_weights) or None, list(d.eval_path), d.tokenizer, 0)
    if bundle.tokenizer_path and not Path(bundle.tokenizer_path).is_file():
        raise ConfigError(f"data.tokenizer={bundle.tokenizer_path}: file not found; train one with "
                          f"scripts/train_tokenizer.py")
    tok_vocab = Tokenizer.load(bundle.tokenizer_path).vocab_size if bundle.tokenizer_path else None
    vocab = cfg.model.vocab_size or tok_vocab
    if vocab is None:
        raise ConfigError("model.vocab_size is unset and there is no data.tokenizer to take it from")
    if tok_vocab is not None and tok_vocab > vocab:
        raise ConfigError(f"data.tokenizer has {tok_vocab} tokens but model.vocab_size={vocab}; token ids would "
                          f"fall outside the embedding: raise model.vocab_size to >= {tok_vocab} or leave it unset")
    for prefix in bundle.train_prefixes + bundle.eval_prefixes:
        IndexedTokenDataset(prefix).validate_vocab(vocab)
    bundle.vocab_size = vocab
    return bundle


def model_config(cfg: RunConfig, vocab_size: int):
    """The GPT configuration: the preset, with every field the run config sets overriding it."""
    from zerotron.model import get_preset

    base = get_preset(cfg.model.preset)
    overrides = {k: v for k, v in dataclasses.asdict(cfg.model).items()
                 if k != "preset" and v is not None and hasattr(base, k)}
    overrides["vocab_size"] = vocab_size
    mcfg = dataclasses.replace(base, **overrides)
    mcfg.validate(cfg.parallel.tp)
    return mcfg


def build_grid(cfg: RunConfig) -> Grid:
    return Grid(ParallelDims(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp))


def zero_config(cfg: RunConfig):
    from zerotron.zero import ZeroConfig

    z, o = cfg.zero, cfg.optimizer
    zcfg = ZeroConfig(stage=z.stage, precision=cfg.training.precision, overlap_comm=z.overlap_comm,
                      contiguous_gradients=z.contiguous_gradients, reduce_bucket_size=z.reduce_bucket_size,
                      allgather_bucket_size=z.allgather_bucket_size,
                      stage3_prefetch_bucket_size=z.stage3_prefetch_bucket_size,
                      stage3_param_persistence_threshold=z.stage3_param_persistence_threshold,
                      offload_optimizer=z.offload_optimizer, initial_loss_scale=o.initial_loss_scale,
                      loss_scale_window=o.loss_scale_window, hysteresis=o.hysteresis, min_loss_scale=o.min_loss_scale)
    zcfg.validate()
    return zcfg
