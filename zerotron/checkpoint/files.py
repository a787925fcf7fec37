"""Files of a checkpoint: atomic writes, checksums, and finding the newest complete checkpoint.

A checkpoint is the directory ``<save>/step_XXXXXXXX``. It is built under a ``.tmp`` name and
renamed only after every rank's shard and the ``metadata.json`` that lists their SHA-256 sums
have been fsynced, so a crash at any point leaves the previous checkpoint as the newest complete
one. Shards are safetensors files (no pickle: loading can never run code).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import safe_open, save_file

from zerotron.data.atomic import publish
from zerotron.checkpoint.schema import (FORMAT_VERSION, LOAD_EARLIER, STEP_DIR,  # noqa: F401
                                                 CheckpointError, check_metadata, inside)

PARTIAL_STEP_DIR = re.compile(r"^step_(\d{8})\.tmp$")  # a save that has not committed (renamed) yet
def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary name, fsync, rename: readers see all or nothing."""
    tmp = path.with_name(path.name + ".partial")
    tmp.write_bytes(data)
    publish(str(tmp), str(path))


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode())


def write_shard(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> str:
    """Save tensors atomically as safetensors with JSON metadata; returns the file's SHA-256."""
    tmp = path.with_name(path.name + ".partial")
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp),
                  metadata={"zerotron": json.dumps(meta)})
    except SafetensorError as e:  # its I/O errors are not OSErrors: a full disk must read as one
        code = re.search(r"os error (\d+)", str(e))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(tmp)) from e
    publish(str(tmp), str(path))
    return sha256_file(path)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def verify_file(path: Path, expected_sha: str) -> None:
    if not path.exists():
        raise CheckpointError(f"checkpoint shard {path} is missing; the checkpoint is incomplete")
    actual = sha256_file(path)
    if actual != expected_sha:
        raise CheckpointError(f"checkpoint shard {path} is corrupt: SHA-256 {actual[:12]}… does not match the "
                              f"{expected_sha[:12]}… recorded in metadata.json" + LOAD_EARLIER)


class ShardReader:
    """Reads slices of tensors from verified safetensors shards, one open file at a time."""

    def __init__(self, directory: Path, files: dict[str, dict], verified: set[str] | frozenset = frozenset()):
        # ``verified``: shards already hashed at start-up (``resume.verify``), not hashed again
        self.directory, self.files, self._verified = directory, files, set(verified)

    def _verified_path(self, filename: str) -> str:

        if filename not in self.files:
            raise CheckpointError(f"{self.directory}: shard {filename} is not listed in metadata.json")
        path = inside(self.directory, filename, "files")
        if filename not in self._verified:  # hash each shard once, before its first use
            verify_file(path, self.files[filename]["sha256"])
            self._verified.add(filename)
        return str(path)

    def read(self, filename: str, key: str, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of the flat tensor ``key``, read without loading the rest."""
        with self._open(filename) as f:
            try:
                out = f.get_slice(key)[start:end]
            except SafetensorError as e:
                raise self._corrupt(filename, f"no tensor {key!r} ({e})") from None
        if out.numel() != end - start:  # the index points past the tensor the shard holds
            raise self._corrupt(filename, f"{key} holds fewer elements than the index names")
        return out

    def tensors_with_prefix(self, filename: str, prefix: str) -> dict[str, torch.Tensor]:
        """Every tensor of a shard whose key starts with ``prefix``, keyed without the prefix."""
        with self._open(filename) as f:
            return {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}

    @contextlib.contextmanager
    def _open(self, filename: str):
        """The shard opened with safetensors; a file that is not one (a pickle whose SHA-256 was
        written into metadata.json) is named corrupt, never parsed further."""
        path = self._verified_path(filename)
        try:
            handle = safe_open(path, framework="pt")
        except (SafetensorError, OSError, ValueError) as e:
            raise self._corrupt(filename, f"not a safetensors file ({e})") from None
        with handle as f:
            yield f

    def _corrupt(self, filename: str, why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint shard {self.directory / filename} is corrupt: {why}"
                               + LOAD_EARLIER)


def step_dir(save: str | Path, step: int) -> Path:
    return Path(save) / f"step_{step:08d}"


def complete_checkpoints(save: str | Path) -> list[Path]:
    """Complete checkpoints under ``save``, oldest first (a ``metadata.json`` marks completion)."""
    root = Path(save)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / "metadata.json").is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def check_checkpoint_path(load: str | Path, field: str = "checkpoint.load") -> Path:
    """``load`` names a directory that can hold checkpoints: not a file inside one (its step
    directory is meant), not a ``step_XXXXXXXX.tmp`` directory (a save that never committed: the rename to
    ``step_XXXXXXXX`` is what marks a checkpoint complete). Raises naming ``field``."""
    path = Path(load)
    if path.is_file():
        hint = (f"give the checkpoint's directory, {path.parent}" if (path.parent / "metadata.json").is_file()
                else "give a step_XXXXXXXX directory or the save directory holding them")
        raise CheckpointError(f"{field}={load} is a file; {hint}")
    if PARTIAL_STEP_DIR.match(path.name):
        raise CheckpointError(f"{field}={load} is a partial checkpoint (a save that did not finish; a complete "
                              f"one is renamed to {path.name.removesuffix('.tmp')}); give its save directory, "
                              f"{path.parent}, to load the newest complete one")
    return path


def resolve_load_path(load: str | Path, field: str = "checkpoint.load",
                      otherwise: str = "pass --load none to start from scratch") -> tuple[Path, list[str]]:
    """The checkpoint to load from ``load`` (a step directory or a save directory) and notes to print.

    A save directory resolves to its newest *complete* checkpoint; partial ones (``.tmp``
    directories left by a crash mid-write) are skipped, and the notes say so. Errors name
    ``field`` and end with ``otherwise``, what else the caller can do.
    """
    path = check_checkpoint_path(load, field)
    notes: list[str] = []
    if (path / "metadata.json").is_file():
        return path, notes
    if not path.exists():
        raise CheckpointError(f"{field}={load}: no such file or directory")
    complete = complete_checkpoints(path)
    partial = sorted(p.name for p in path.iterdir() if p.name.endswith(".tmp") or
                     (STEP_DIR.match(p.name) and not (p / "metadata.json").is_file()))
    if not complete:
        raise CheckpointError(f"{field}={load}: no complete checkpoint found"
                              + (f" (partial: {', '.join(partial)})" if partial else "")
                              + f"; point {field} at a step_XXXXXXXX directory or a save directory holding one"
                              + (f", or {otherwise}" if otherwise else ""))
    newest = complete[-1]
    newer_partial = [n for n in partial if n.split(".")[0] > newest.name]
    if newer_partial:
        notes.append(f"skipping partial checkpoint(s) {', '.join(newer_partial)} (a write was interrupted); "
                     f"loading the last complete one, {newest.name}")
    return newest, notes


def read_metadata(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((path / "metadata.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: metadata.json is missing; the checkpoint is incomplete") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}/metadata.json is corrupt ({e})" + LOAD_EARLIER) from None
    except OSError as e:
        raise CheckpointError(f"{path}/metadata.json cannot be read ({e})") from None

    return check_metadata(meta, path)  # sealed, well formed, every file it names inside ``path``


OWNER = "OWNER"  # run id of the run writing a ``.tmp`` directory; removed before the rename


def owner(path: Path) -> str | None:
    """Run id of the run that wrote checkpoint ``path`` (complete or ``.tmp``); None if unknown."""
    try:
        return json.loads((path / "metadata.json").read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        pass
    try:
        return (path / OWNER).read_text().strip() or None
    except OSError:
        return None


def step_of(path: Path) -> int | None:
    m = STEP_DIR.match(path.name.removesuffix(".tmp"))
    return int(m.group(1)) if m else None


def prune(save: str | Path, keep_last: int, run_id: str, current_step: int) -> None:
    """Delete this run's complete checkpoints but the newest ``keep_last`` up to ``current_step``,
    and this run's stale ``.tmp`` directories.

    Only checkpoints whose metadata names ``run_id`` are touched: another run's checkpoints in
    the same directory (one this run continued from, say) are never deleted. This run's
    checkpoints newer than ``current_step`` (left when it was resumed from an earlier one) are
    kept too; each is replaced when the run saves that step again. A ``step_XXXXXXXX.replaced``
    (``write.commit_checkpoint`` moves a step directory it saves again aside) is debris of such a save.
    """
    mine = [p for p in complete_checkpoints(save) if owner(p) == run_id and step_of(p) <= current_step]
    for old in mine[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for p in Path(save).iterdir():
        if p.name.endswith(".tmp") and step_of(p) is not None and step_of(p) < current_step and owner(p) == run_id:
            shutil.rmtree(p, ignore_errors=True)
        elif p.name.endswith(".replaced") and STEP_DIR.match(p.name.removesuffix(".replaced")):
            shutil.rmtree(p, ignore_errors=True)  # a replaced checkpoint whose deletion a kill interrupted
