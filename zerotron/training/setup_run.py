"""A run's checks before any process group (``before_any_group``, ``preflight``), and the pieces
``build_run.py`` assembles after it: the grid, the token files and tokenizer, the model's config.

Kept apart from the loop so tests and benchmarks can build the same pieces. Everything that can
fail on bad input (config, tokenizer, token files) fails here, on every rank, before the first
training collective.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path


from zerotron.parallel import Grid
from zerotron.parallel.context_parallel import check_context_parallel
from zerotron.config.run_config import ConfigError, RunConfig


@dataclass
class DataBundle:
    train_prefixes: list[str]
    train_weights: list[float] | None
    eval_prefixes: list[str]
    tokenizer_path: str | None
    vocab_size: int


def prepare_data(cfg: RunConfig, grid: Grid, device) -> DataBundle:
    """Token files and tokenizer: the built-in corpus (rank 0 builds, the others wait for its
    outcome, so a build that fails stops every rank with rank 0's reason) or the user's."""
    from zerotron.data import build_default_corpus
    from zerotron.parallel.agreement import rank0_decides

    d = cfg.data
    if not d.data_path:
        def build() -> None:  # rank 0 builds; the others wait for its outcome, then read it
            try:
                build_default_corpus(d.cache_dir, vocab_size=d.default_corpus_vocab, tokenizer=d.tokenizer)
            except (OSError, ValueError) as e:
                raise ConfigError(f"the built-in corpus could not be built in data.cache_dir={d.cache_dir} with "
                                  f"data.default_corpus_vocab={d.default_corpus_vocab} (the default is 1024): "
                                  f"{e}") from None
        rank0_decides(build, grid, device, failures=(ConfigError,))
        train, tok_path, evals = build_default_corpus(d.cache_dir, vocab_size=d.default_corpus_vocab,
                                                      tokenizer=d.tokenizer)
        bundle = DataBundle([train], None, [evals], tok_path, 0)
    else:
        bundle = DataBundle(list(d.data_path), list(d.data_weights) or None, list(d.eval_path), d.tokenizer, 0)
    bundle.vocab_size = check_data(cfg, bundle.tokenizer_path, bundle.train_prefixes, bundle.eval_prefixes)
    return bundle


def check_data(cfg: RunConfig, tokenizer_path: str | None, train: list[str], evals: list[str]) -> int:
    """Tokenizer and token files against the model's vocabulary; returns the vocabulary size.

    Raises ``ConfigError`` naming the field (``data.tokenizer``, ``data.data_path``,
    ``data.eval_path``, ``model.vocab_size``, ``model.seq_length``), the file and the fix -- never
    a crash mid-run. A file must hold at least one sample (``seq_length + 1`` tokens: the inputs
    and their shifted labels).
    """
    from zerotron.data import IndexedTokenDataset, Tokenizer, fingerprint
    from zerotron.data.tokenizer import encoding_digest

    if tokenizer_path and not Path(tokenizer_path).exists():
        raise ConfigError(f"data.tokenizer={tokenizer_path}: not found; train one with "
                          f"scripts/train_tokenizer.py, or name a Hugging Face tokenizer directory")
    try:
        tok_vocab = Tokenizer.load(tokenizer_path).vocab_size if tokenizer_path else None
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.tokenizer={tokenizer_path}: {e}") from None
    vocab = cfg.model.vocab_size or tok_vocab
    if vocab is None:
        raise ConfigError("model.vocab_size is unset and there is no data.tokenizer to take it from")
    if tok_vocab is not None and tok_vocab > vocab:
        raise ConfigError(f"data.tokenizer has {tok_vocab} tokens but model.vocab_size={vocab}; token ids would "
                          f"fall outside the embedding: raise model.vocab_size to >= {tok_vocab} or leave it unset")
    seq = _seq_length(cfg)
    digest = encoding_digest(tokenizer_path) if tokenizer_path else None  # once for all files
    for field_name, prefixes in (("data.data_path", train), ("data.eval_path", evals)):
        for prefix in prefixes:
            try:
                ds = IndexedTokenDataset(prefix)  # opening maps the files; the scan below reads them
                if tok_vocab is not None and ds.vocab_size != tok_vocab:  # ids of another tokenizer
                    raise ValueError(f"was tokenized with a {ds.vocab_size}-token vocabulary (its .idx header) but "
                                     f"data.tokenizer={tokenizer_path} has {tok_vocab} tokens; set data.tokenizer "
                                     f"to the tokenizer it was made with, or re-run scripts/preprocess_data.py "
                                     f"with this one")
                other = fingerprint.mismatch(prefix, tokenizer_path, digest) if digest else None
                if other:  # the record beside the files names another tokenizer
                    raise ValueError(f"{other}; set data.tokenizer to the tokenizer it was made "
                                     f"with, or re-run scripts/preprocess_data.py with this one")
                if seq is not None and ds.num_tokens < seq + 1:
                    raise ValueError(f"holds {ds.num_tokens} tokens, fewer than model.seq_length + 1 = {seq + 1} "
                                     f"(one sample); use a larger corpus or a shorter model.seq_length")
                key = (_file_identity(prefix), vocab)
                if key in _CHECKED_FILES:  # preflight checked it; the trainer's start-up need not re-scan
                    continue
                _check_index(ds)
                ds.validate_vocab(vocab)
                _CHECKED_FILES.add(key)
            except (OSError, ValueError) as e:
                raise ConfigError(f"{field_name}={prefix}: {e}") from None
    return vocab


def _seq_length(cfg: RunConfig) -> int | None:
    """The run's sequence length: the override, else the preset's (None for an unknown preset,
    which ``validate_model`` reports)."""
    from zerotron.model.presets import PRESETS

    if cfg.model.seq_length is not None:
        return cfg.model.seq_length
    preset = PRESETS.get(cfg.model.preset)
    return preset.seq_length if preset is not None else None


# Token files this process has scanned in full, by (path, size, mtime) of .bin and .idx and the
# vocabulary they were checked against: a changed file is scanned again.
_CHECKED_FILES: set = set()


def _file_identity(prefix: str) -> tuple:
    out = []
    for suffix in (".bin", ".idx"):
        st = Path(prefix + suffix).stat()
        out.append((prefix + suffix, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _check_index(ds) -> None:
    """The ``.idx``'s per-document sizes must agree with its offsets (a corrupted index would send
    samples to the wrong tokens, or past the end of the ``.bin``, mid-run). O(documents), chunked."""
    n, chunk = len(ds.sizes), 1 << 24
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        diff = ds.offsets[lo + 1:hi + 1] - ds.offsets[lo:hi]
        bad = (diff != ds.sizes[lo:hi]) | (ds.sizes[lo:hi] < 0)
        if bad.any():
            doc = lo + int(bad.argmax())
            raise ValueError(f"{ds.prefix}.idx is corrupt: document {doc} has size {int(ds.sizes[doc])} but its "
                             f"offsets span {int(diff[doc - lo])} tokens; re-create it with "
                             f"scripts/preprocess_data.py")


def model_config(cfg: RunConfig, vocab_size: int, tokenizer_path: str | None = None):
    """The GPT configuration: the preset, with every field the run config sets overriding it; with
    document masking on and no ``model.eod_token_id``, the end-of-document id of
    ``tokenizer_path``."""
    from zerotron.model import get_preset

    base = get_preset(cfg.model.preset)
    overrides = {k: v for k, v in dataclasses.asdict(cfg.model).items()
                 if k != "preset" and v is not None and hasattr(base, k)}
    overrides["vocab_size"] = vocab_size
    mcfg = dataclasses.replace(base, **overrides)
    if mcfg.document_masking and mcfg.eod_token_id is None and tokenizer_path is not None:
        from zerotron.data.tokenizer import Tokenizer
        mcfg.eod_token_id = Tokenizer.load(str(tokenizer_path)).eod_id
    mcfg.validate(cfg.parallel.tp)
    par = cfg.parallel
    check_context_parallel(mcfg.seq_length, par.cp, par.tp, par.sequence_parallel, mcfg.attention_dropout)
    return mcfg


def build_grid(cfg: RunConfig) -> Grid:
    return Grid(cfg.parallel)


# --- start-up validation before any process group ----------------------------------------
def validate_model(cfg: RunConfig, vocab_size: int | None = None):
    """The model (preset + overrides) and its pipeline split, checked without a process group so
    every rank rejects a bad config before any collective (``RunConfig.validate`` did the rest).

    ``vocab_size`` unknown (a tokenizer not read yet): ``model.vocab_size``, the built-in corpus's
    vocabulary, else a placeholder -- the vocabulary only pads, it never makes a shape invalid.
    Returns the ``GPTConfig``; raises ``ConfigError`` naming ``section.field``.
    """
    from zerotron.model import get_preset
    from zerotron.model.presets import PRESETS
    from zerotron.model.stages import split_layers
    from zerotron.training.parallelize import check_number_checkpoints

    if cfg.model.preset not in PRESETS:
        raise ConfigError(f"model.preset={cfg.model.preset!r} is not a known preset; choose one of {sorted(PRESETS)}")
    vocab = (vocab_size or cfg.model.vocab_size or (None if cfg.data.data_path else cfg.data.default_corpus_vocab)
             or get_preset(cfg.model.preset).vocab_size)
    try:
        mcfg = model_config(cfg, vocab)
        if mcfg.document_masking and mcfg.eod_token_id is None:  # the tokenizer's, at run time;
            from zerotron.data.tokenizer import EOD_ID  # any id gives the same shapes till then
            mcfg.eod_token_id = EOD_ID
        if mcfg.document_masking and cfg.parallel.pp > 1:
            raise ConfigError(f"model.reset_attention_mask/reset_position_ids with "
                              f"parallel.pp={cfg.parallel.pp}: the packed documents' layout does "
                              f"not travel between pipeline stages yet; use parallel.pp=1 or turn "
                              f"document masking off")
        split_layers(mcfg.num_layers, cfg.parallel.pp, virtual_stages=cfg.parallel.virtual_stages)
        check_number_checkpoints(cfg, mcfg.num_layers)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None
    return mcfg


def before_any_group(cfg: RunConfig) -> None:
    """What a run checks on every rank before ``init_process_group``, in order: the config
    (``RunConfig.validate``), then ``preflight``; rank 0 then says the settings that have no
    effect in this run (``config/inert.py``). Raises ``ConfigError`` (exit 2)."""
    from zerotron.config.inert import no_effect

    cfg.validate(int(os.environ.get("WORLD_SIZE", 1)))
    preflight(cfg)  # model shape, pipeline split, ZeRO settings, the user's token files
    if int(os.environ.get("RANK", 0)) == 0:
        for line in no_effect(cfg):
            print(f"[config] {line}", flush=True)


def preflight(cfg: RunConfig) -> None:
    """Everything checkable before ``init_process_group`` beyond ``RunConfig.validate``: the model,
    the user's data files (the built-in corpus is built after start-up by rank 0), whether a
    rank can hold the run (``fit_check.py``) and the run and checkpoint directories. Raises
    ``ConfigError``."""
    from zerotron.config.env_check import check_environment, check_paths

    check_environment()  # ZEROTRON_* variables: exit 2 naming one, not a traceback at start-up
    check_paths(cfg)
    vocab = None
    if cfg.data.data_path or cfg.data.tokenizer:  # without data_path: the built-in corpus's tokenizer
        vocab = check_data(cfg, cfg.data.tokenizer, list(cfg.data.data_path), list(cfg.data.eval_path))
    mcfg = validate_model(cfg, vocab)
    if cfg.checkpoint.init_from_hf:  # every tensor there, of its shape: refused before any group
        from zerotron.checkpoint.hf_import import check_directory
        check_directory(cfg, mcfg)
    from zerotron.training.fit_check import check_fit

    check_fit(cfg, mcfg, int(os.environ.get("WORLD_SIZE", 1)))  # cannot fit: refused in seconds
    writable_dir("logging.run_dir", cfg.logging.run_dir, "the run's metrics and config")  # before a save dir in it
    from zerotron.checkpoint.run_lock import RunLockError, check_free

    try:  # a live run's run directory: refused now, not after init_process_group (locked there)
        check_free(cfg.logging.run_dir, "logging.run_dir")
    except RunLockError as e:
        raise ConfigError(str(e)) from None
    check_save_dir(cfg, mcfg)
    writable_dir("data.cache_dir", cfg.data.cache_dir, "the built-in corpus and the sample-index caches")


def checkpoint_bytes(cfg: RunConfig, mcfg) -> tuple[int, int, int]:
    """``(bytes, parameters, bytes per parameter)`` of one checkpoint, summed over all ranks.

    Per parameter: what a shard holds -- the master weight and Adam's two moments in the master
    dtype (fp32; fp64 for fp64 runs), 12 (24) bytes of ZeRO §3.1's states, stored once over all
    ranks (TP splits, ZeRO partitions); the model's own copy is not saved (it is the master,
    rounded), except in ``consolidated.safetensors`` when ``checkpoint.consolidated_16bit`` is
    set. With a pipeline the tied word embedding lives on the first and the last stage."""
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    n = mcfg.exact_num_params(tp) + (mcfg.padded_vocab_size(tp) * mcfg.hidden_size if pp > 1 else 0)
    model_bytes = {"fp16": 2, "bf16": 2, "fp32": 4, "fp64": 8}.get(cfg.training.precision, 4)
    consolidated = min(model_bytes, 4) if cfg.checkpoint.consolidated_16bit else 0  # fp32 at most
    per = 3 * (8 if cfg.training.precision == "fp64" else 4) + consolidated
    return n * per, n, per


def check_save_dir(cfg: RunConfig, mcfg) -> None:
    """``checkpoint.save`` (when set) must be a directory this rank can write, on a file system
    with room for one checkpoint -- found out now, not after hours of training. A directory not
    yet created is judged by its nearest existing parent, which is where it will be made."""
    import shutil

    path = cfg.checkpoint.save
    if not path:
        return
    where = writable_dir("checkpoint.save", path, "checkpoints", "or unset it to run without checkpoints")
    from zerotron.checkpoint.files import PARTIAL_STEP_DIR, STEP_DIR

    for above in [Path(path).absolute(), *Path(path).absolute().parents]:  # pruning reaches in
        step = STEP_DIR.match(above.name) or PARTIAL_STEP_DIR.match(above.name)
        if step or (above / "metadata.json").is_file():
            raise ConfigError(f"checkpoint.save={path} is inside the checkpoint {above}; give a "
                              f"directory outside any checkpoint")
    from zerotron.checkpoint.run_lock import RunLockError, check_free

    try:  # a live run's directory: refused now, not after init_process_group (the lock is taken there)
        check_free(path)
    except RunLockError as e:
        raise ConfigError(str(e)) from None
    need, n, per = checkpoint_bytes(cfg, mcfg)
    free = shutil.disk_usage(where).free
    if free < need:
        raise ConfigError(f"checkpoint.save={path}: one checkpoint needs about {_gib(need)} ({n:,} parameters x "
                          f"{per} bytes: master weights and two Adam moments) but "
                          f"{where} has {_gib(free)} free; free space, choose a larger file system, or unset "
                          f"checkpoint.save")


def writable_dir(field: str, path: str, holds: str, alternative: str = "") -> Path:
    """``path`` is a directory this rank can write in, or can be created: a directory not yet there
    is judged by its nearest existing parent, where it will be made. Returns that directory;
    raises ``ConfigError`` naming ``field``."""
    from zerotron.data.atomic import nearest_existing, write_probe

    where = Path(nearest_existing(path))
    also = f", {alternative}" if alternative else ""
    if not where.is_dir():
        raise ConfigError(f"{field}={path}: {where} is a file, not a directory; point {field} at a directory "
                          f"(or a path to create) for {holds}{also}")
    problem = write_probe(where)
    if problem is not None:
        raise ConfigError(f"{field}={path}: cannot write in {where} ({problem}); {field} holds {holds}: "
                          f"choose a writable directory or fix its permissions{also}")
    return where


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"
