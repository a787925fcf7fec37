"""``metadata.json`` read as untrusted input: sealed by its own checksum, checked against a schema
before anything is allocated, and every file it names kept inside its checkpoint directory.

Why: the shards are checksummed, but until now the file that lists the checksums was not. A
damaged or edited ``metadata.json`` gave tracebacks (a shape of ``1e12``, a step of ``"two"``),
petabyte allocations (an index range past the shard), a load from outside the checkpoint (a
shard named ``../../outside/rank_00001.safetensors``) or a run "complete at step 1000" inside
``step_00000002``. Now:

* ``seal`` adds ``metadata_sha256``, the SHA-256 of the rest in canonical JSON; a checkpoint
  whose metadata does not match it (or lacks it) is corrupt, whatever changed.
* ``check_metadata`` validates every field the loaders read -- types, ranges, the layout's
  product, each index range within its parameter and its shard's bytes on disk -- and raises
  ``CheckpointError`` naming the field, so a resealed but hostile file is refused too. The
  model section is checked generically: its ``GPTConfig`` fields are rebuilt and validated by
  ``GPTConfig.validate`` (a new model field is covered without touching this module).
* ``inside`` resolves a name the checkpoint gives to a path inside its directory: a plain file
  name (no separator, no ``..``, not absolute) whose resolved path, symlinks followed, stays in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
STEP_DIR = re.compile(r"^step_(\d{8})$")
LOAD_EARLIER = "; load an earlier checkpoint"  # the fix a damaged checkpoint's message ends with


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model/layout."""


SEAL = "metadata_sha256"
SHARD_NAME = re.compile(r"^rank_(\d{5})\.safetensors$")
TOKENIZER_FILE = "tokenizer.model"
TOKENIZER_DIR = "tokenizer"  # a Hugging Face tokenizer's files (data.hf_tokenizer.KEPT_FILES)
MAX_COUNT = 2**53  # steps, samples, offsets: exact in every JSON reader
MAX_BATCH = 2**24  # samples in one global batch: bounds consumed_samples by the step
MAX_WORLD = 2**20
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
MASTER_BYTES = 4  # a shard's master, exp_avg, exp_avg_sq: fp32 (fp64 in fp64 runs), >= 4 bytes


def _error(path: Path, text: str):

    return CheckpointError(f"{path}/metadata.json is corrupt: {text}" + LOAD_EARLIER)


def canonical(meta: dict) -> bytes:
    """The bytes the seal is computed over: everything but the seal, keys sorted, no spaces."""
    rest = {k: v for k, v in meta.items() if k != SEAL}
    return json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()


def seal(meta: dict) -> dict:
    """``meta`` as JSON will read it back (tuples as lists, keys as strings), its checksum added:
    what ``write.commit_checkpoint`` writes."""
    plain = json.loads(json.dumps(meta))
    return {**plain, SEAL: hashlib.sha256(canonical(plain)).hexdigest()}


def inside(directory: Path, name: Any, field: str) -> Path:
    """``directory / name`` if ``name`` is a plain file name whose resolved path (symlinks
    followed) stays inside ``directory``; raises ``CheckpointError`` naming ``field`` otherwise."""
    plain = (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
             and "\\" not in name and "\x00" not in name)
    if not plain:
        raise _error(directory, f"{field}={name!r} is not a file name inside the checkpoint "
                                f"(no path separators, no '..', not absolute)")
    target = directory / name
    root = directory.resolve()
    if target.is_symlink() or target.exists():
        resolved = target.resolve()
        if resolved.parent != root:
            raise _error(directory, f"{field}={name!r} is a link to {resolved}, outside the "
                                    f"checkpoint")
    return target


def _int(value: Any, field: str, path: Path, lo: int = 0, hi: int = MAX_COUNT) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise _error(path, f"{field}={value!r} must be an integer in [{lo}, {hi}]")
    return value


def _dict(value: Any, field: str, path: Path) -> dict:
    if not isinstance(value, dict):
        raise _error(path, f"{field} must be an object, got {type(value).__name__}")
    return value


def _need(meta: dict, key: str, path: Path, prefix: str = "") -> Any:
    if key not in meta:
        raise _error(path, f"field {prefix}{key} is missing")
    return meta[key]


def check_metadata(meta: Any, path: Path) -> dict:
    """Raise ``CheckpointError`` unless ``meta`` is sealed and well formed for checkpoint ``path``;
    returns it. Reads no shard: only the sizes of the files it names."""

    meta = _dict(meta, "metadata.json", path)
    got = meta.get(SEAL)
    if not isinstance(got, str) or hashlib.sha256(canonical(meta)).hexdigest() != got:
        if got is None:  # no earlier checkpoint of that zerotron is sealed either: another fix

            raise CheckpointError(f"{path}/metadata.json carries no checksum ({SEAL}): written "
                                  f"before checkpoints were sealed, or edited; if you trust it, "
                                  f"add one with zerotron.checkpoint.schema.seal")
        raise _error(path, f"its checksum does not match its contents ({SEAL}; it was edited or "
                           f"damaged after it was written)")
    if meta.get("format_version") != FORMAT_VERSION:

        raise CheckpointError(f"{path}: checkpoint format version {meta.get('format_version')!r} "
                              f"is not {FORMAT_VERSION}, the one this zerotron reads")
    step = _int(_need(meta, "step", path), "step", path)
    named = STEP_DIR.match(path.name)
    if named and int(named.group(1)) != step:
        raise _error(path, f"step={step} but the directory is {path.name}")
    _int(_need(meta, "consumed_samples", path), "consumed_samples", path, 0, step * MAX_BATCH)
    _int(meta.get("adam_step", step), "adam_step", path, 0, step)
    if not isinstance(_need(meta, "run_id", path), str):
        raise _error(path, f"run_id={meta['run_id']!r} must be a string")
    _check_scaler(meta.get("loss_scaler"), path)
    layout = _check_layout(_dict(_need(meta, "layout", path), "layout", path), path)
    _check_model(_dict(_need(meta, "model", path), "model", path), layout["tp"], path)
    for section, values in _dict(meta.get("config", {}), "config", path).items():
        _dict(values, f"config.{section}", path)
    params = _check_params(_dict(_need(meta, "params", path), "params", path), path)
    _check_files(_dict(_need(meta, "files", path), "files", path), params, layout, path)
    tok = meta.get("tokenizer")
    if tok is not None:
        tok = _dict(tok, "tokenizer", path)
        if tok.get("file") not in (TOKENIZER_FILE, TOKENIZER_DIR):
            raise _error(path, f"tokenizer.file={tok.get('file')!r}: a checkpoint keeps its "
                               f"tokenizer as {TOKENIZER_FILE} or in {TOKENIZER_DIR}/")
        inside(path, tok["file"], "tokenizer.file")
        if tok["file"] == TOKENIZER_DIR:  # each file of the copy inside it too
            from zerotron.data.hf_tokenizer import KEPT_FILES
            for name in KEPT_FILES:
                inside(path / TOKENIZER_DIR, name, f"tokenizer.file's {name}")
        if not isinstance(tok.get("sha256"), str) or not _HEX64.match(tok["sha256"]):
            raise _error(path, f"tokenizer.sha256={tok.get('sha256')!r} is not a SHA-256")
        if not isinstance(tok.get("path"), str):
            raise _error(path, f"tokenizer.path={tok.get('path')!r} must be a string")
    return meta


def _check_scaler(scaler: Any, path: Path) -> None:
    if scaler is None:
        return
    scaler = _dict(scaler, "loss_scaler", path)
    scale = scaler.get("scale")
    number = isinstance(scale, (int, float)) and not isinstance(scale, bool)
    if not number or not (math.isfinite(scale) and scale > 0):
        raise _error(path, f"loss_scaler.scale={scale!r} must be a finite number > 0")
    for key in ("hysteresis_left", "clean_steps"):
        if key in scaler:
            _int(scaler[key], f"loss_scaler.{key}", path)
    if not isinstance(scaler.get("dynamic", False), bool):
        raise _error(path, f"loss_scaler.dynamic={scaler['dynamic']!r} must be true or false")


def _check_layout(layout: dict, path: Path) -> dict:
    for key in ("tp", "pp", "dp", "world_size"):
        _int(_need(layout, key, path, "layout."), f"layout.{key}", path, 1, MAX_WORLD)
    _int(_need(layout, "stage", path, "layout."), "layout.stage", path, 0, 3)
    _int(layout.get("virtual_stages", 1), "layout.virtual_stages", path, 1, MAX_WORLD)
    _int(layout.get("cp", 1), "layout.cp", path, 1, MAX_WORLD)  # absent before context parallelism
    cp = layout.get("cp", 1)
    if layout["tp"] * layout["pp"] * layout["dp"] * cp != layout["world_size"]:
        raise _error(path, f"layout tp x pp x dp x cp = {layout['tp']} x {layout['pp']} x "
                           f"{layout['dp']} x {cp} is not world_size={layout['world_size']}")
    return layout


def _check_model(model: dict, tp: int, path: Path) -> None:
    """Every ``GPTConfig`` field present is rebuilt and validated as the run's own config is;
    fields this zerotron does not know are left to the comparison with the run's model. An empty
    section is a library caller's save that named no model (``Checkpointer.track(model, opt, {})``):
    the shapes in ``params`` are still checked against the model it loads into."""
    from zerotron.model.config import GPTConfig

    if not model:
        return
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    try:
        GPTConfig(**{k: v for k, v in model.items() if k in known}).validate(tp)
    except (TypeError, ValueError, ArithmeticError) as e:
        raise _error(path, f"model: {e}") from None


def _check_params(params: dict, path: Path) -> dict[str, tuple[list[int], int | None]]:
    out = {}
    for name, info in params.items():
        info = _dict(info, f"params[{name!r}]", path)
        shape = info.get("global_shape")
        dims_ok = isinstance(shape, list) and 1 <= len(shape) <= 4 and all(
            isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= 2**40 for d in shape)
        if not dims_ok:
            raise _error(path, f"params[{name!r}].global_shape={shape!r} must be 1 to 4 positive "
                               f"integers")
        dim = _need(info, "tp_split_dim", path, f"params[{name!r}].")
        if dim is not None:
            _int(dim, f"params[{name!r}].tp_split_dim", path, 0, len(shape) - 1)
        out[name] = (shape, dim)
    if not out:
        raise _error(path, "params lists no parameter")
    return out


def _local_numel(shape: list[int], dim: int | None, tp: int) -> int:
    """Elements of one TP rank's slice, as the assembler cuts it."""
    return math.prod(d // tp if i == dim else d for i, d in enumerate(shape))


def _check_files(files: dict, params: dict, layout: dict, path: Path) -> None:
    """Shard names, checksums and index entries; each index range inside its parameter, the
    ranges of one shard disjoint and inside the bytes the shard holds on disk, and every TP
    slice of every parameter covered -- so what the assembler allocates is bounded by the disk."""
    want = {f"rank_{r:05d}.safetensors" for r in range(layout["world_size"])}
    if set(files) != want:
        odd = sorted(set(files) ^ want)[:3]
        last = layout["world_size"] - 1
        raise _error(path, f"files must name rank_00000.safetensors .. rank_{last:05d}"
                           f".safetensors, one per rank of layout.world_size; {odd!r} do not fit")
    covered: dict[tuple[str, int], int] = {}
    tp = layout["tp"]
    for filename, entry in files.items():
        entry = _dict(entry, f"files[{filename!r}]", path)
        field = f"files[{filename!r}]"
        target = inside(path, filename, "files")
        if not isinstance(entry.get("sha256"), str) or not _HEX64.match(entry["sha256"]):
            raise _error(path, f"{field}.sha256={entry.get('sha256')!r} is not a SHA-256")
        index = entry.get("index")
        if not isinstance(index, list):
            raise _error(path, f"{field}.index must be a list")
        extents = []
        for k, row in enumerate(index):
            where = f"{field}.index[{k}]"
            if (not isinstance(row, list) or len(row) != 5 or not isinstance(row[0], str)
                    or row[0] not in params):
                raise _error(path, f"{where}={row!r} must be [parameter name, tp rank, start, end, "
                                   f"offset]")
            numel = _local_numel(*params[row[0]], tp)
            dim = params[row[0]][1]
            tp_rank = _int(row[1], f"{where} tp rank", path, 0, tp - 1)
            start = _int(row[2], f"{where} start", path, 0, numel)
            end = _int(row[3], f"{where} end", path, start, numel)
            offset = _int(row[4], f"{where} offset", path)
            extents.append((offset, offset + end - start))
            key = (row[0], tp_rank if dim is not None else 0)
            covered[key] = covered.get(key, 0) + end - start
        extents.sort()
        if any(a[1] > b[0] for a, b in zip(extents, extents[1:])):
            raise _error(path, f"{field}.index has overlapping ranges in the shard")
        size = target.stat().st_size if target.is_file() else None  # missing: verify names it
        if size is not None and extents and 3 * MASTER_BYTES * extents[-1][1] > size:
            raise _error(path, f"{field}.index reaches element {extents[-1][1]} but the shard "
                               f"holds {size} bytes")
    for name, (shape, dim) in params.items():
        numel = _local_numel(shape, dim, tp)
        for r in range(tp if dim is not None else 1):
            if covered.get((name, r), 0) < numel:
                raise _error(path, f"params[{name!r}] (TP rank {r}) is not covered by the shards' "
                                   f"index")
