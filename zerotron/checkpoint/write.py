"""One checkpoint save in three phases, each a function so a background save can split them.

``open_checkpoint`` (collective: rank 0 makes ``step_XXXXXXXX.tmp``), ``write_own_shard`` (not
collective: this rank's shard and its sidecar -- a writer thread may run it) and
``commit_checkpoint`` (collective: every rank's write agreed, rank 0 writes ``metadata.json``
and renames ``.tmp`` to ``step_XXXXXXXX``, the commit, then prunes). Each collective phase ends
in ``agree.agree``, so a write that fails on one rank stops every rank with the same message.
A save goes down from here: ``agree`` -> ``files`` -> ``schema``, and the fault hooks of the
drills (``parallel/faults.py``); ``checkpointer.py`` runs the phases, ``async_save.py`` the
middle one on a thread.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from zerotron.parallel import faults
from zerotron.checkpoint.agree import agree
from zerotron.checkpoint.files import (FORMAT_VERSION, OWNER, atomic_write_bytes,
                                       atomic_write_json, prune, step_dir, write_shard)
from zerotron.checkpoint.schema import TOKENIZER_DIR, TOKENIZER_FILE, seal


def _keep_tokenizer(tokenizer: str, directory: Path) -> dict[str, str]:
    """Copy the run's tokenizer into the checkpoint and record where it came from and its SHA-256:
    an export months later must not depend on a cache (the built-in corpus's) or a moved file.
    A Hugging Face tokenizer directory is kept as its files under ``tokenizer/``."""
    if Path(tokenizer).is_dir():
        from zerotron.data.hf_tokenizer import copy_files, files_sha256
        copy_files(Path(tokenizer), directory / TOKENIZER_DIR, atomic_write_bytes)
        return {"path": str(Path(tokenizer).resolve()), "file": TOKENIZER_DIR,
                "sha256": files_sha256(directory / TOKENIZER_DIR)}
    data = Path(tokenizer).read_bytes()
    atomic_write_bytes(directory / TOKENIZER_FILE, data)
    return {"path": str(Path(tokenizer).resolve()), "sha256": hashlib.sha256(data).hexdigest(), "file": TOKENIZER_FILE}


def open_checkpoint(save: str, step: int, grid, run_id: str, device: torch.device) -> Path:
    """Collective: rank 0 makes the empty ``step_XXXXXXXX.tmp`` (naming its run); returns it."""
    tmp = step_dir(save, step).with_name(step_dir(save, step).name + ".tmp")
    error = None  # an OSError (full disk, quota, ...) stops every rank together: agree.py
    if grid.rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            (tmp / OWNER).write_text(run_id)
        except OSError as e:
            error = e
    agree(error, grid, device, tmp, step)
    return tmp


def checkpoint_header(step: int, opt, grid, state: dict, *, consumed_samples: int,
                      model_config: dict, run_config: dict, run_id: str) -> dict:
    """metadata.json but for the shard list, parameters and tokenizer, as of this step. A JSON
    round trip: an asynchronous save commits it later, after the loss scaler has moved on."""
    return json.loads(json.dumps({
        "format_version": FORMAT_VERSION, "step": step, "consumed_samples": consumed_samples,
        "run_id": run_id, "adam_step": int(state.get("step", step)), "loss_scaler": state.get("loss_scaler"),
        "layout": {"tp": grid.tp_size, "pp": grid.pp_size, "dp": grid.dp_size, "cp": grid.cp_size,
                   "stage": opt.stage,
                   "virtual_stages": getattr(grid.dims, "virtual_stages", 1),
                   "world_size": grid.world_size},
        "model": model_config, "config": run_config}))


def write_own_shard(tmp: Path, step: int, grid, tensors: dict[str, torch.Tensor],
                    meta: dict) -> OSError | None:
    """Not collective (a writer thread may run it): this rank's shard and its sidecar JSON;
    returns the write's ``OSError`` (None: written) for the next ``agree``."""
    filename = f"rank_{grid.rank:05d}.safetensors"
    error = None
    try:
        faults.hit("enospc", step, grid.rank, tmp / filename)  # test hook: this rank's disk is full
        sha = write_shard(tmp / filename, tensors, {"rank": grid.rank, "coords": grid.coords})
        atomic_write_json(tmp / f"rank_{grid.rank:05d}.json", {"sha256": sha, **meta})
    except OSError as e:
        error = e
    faults.hit("kill_after_shard", step, grid.rank)  # test hook (parallel/faults.py)
    return error


def commit_checkpoint(save: str, tmp: Path, error: OSError | None, grid, device: torch.device,
                      header: dict, *, keep_last: int, tokenizer: str | None) -> Path:
    """Collective: every rank's shard written (``error``: this rank's), rank 0 writes metadata.json
    and renames ``tmp`` to the step directory -- the commit -- then prunes; returns it."""
    step = header["step"]
    final = step_dir(save, step)
    agree(error, grid, device, tmp, step)
    if grid.rank == 0:
        try:
            files, params = {}, {}
            for r in range(grid.world_size):
                side = tmp / f"rank_{r:05d}.json"
                entry = json.loads(side.read_text())
                params.update(entry.pop("params"))
                files[f"rank_{r:05d}.safetensors"] = entry
            atomic_write_json(tmp / "metadata.json", seal({
                **header, "params": params, "files": files,
                "tokenizer": _keep_tokenizer(tokenizer, tmp) if tokenizer else None}))
            for r in range(grid.world_size):
                (tmp / f"rank_{r:05d}.json").unlink()
            (tmp / OWNER).unlink()  # metadata.json names the run from here on
            faults.hit("kill_before_commit", step, grid.rank)  # test hook: metadata written, not yet renamed
            aside = final.with_name(final.name + ".replaced")  # neither a checkpoint nor a partial one
            if final.exists():  # a kill while it is deleted must not leave a half-deleted step_XXXXXXXX
                shutil.rmtree(aside, ignore_errors=True)
                final.rename(aside)
            tmp.rename(final)
            shutil.rmtree(aside, ignore_errors=True)
        except OSError as e:
            error = e
        else:
            prune(save, keep_last, header["run_id"], step)
    agree(error, grid, device, tmp, step)
    return final
