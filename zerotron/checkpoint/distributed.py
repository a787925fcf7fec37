"""Distributed checkpoints that resume exactly and load into any other TP / PP / DP / ZeRO layout.

Each rank writes one shard: its flat fp32 (fp64 in precision fp64) partitions of the ZeRO
optimizer (master weights, Adam moments) and its RNG states. The shard's index says, for every
parameter slice it holds, ``(name, tp_rank, start, end, offset)``: elements ``[start, end)`` of
that TP rank's flattened parameter live at ``offset`` of the shard's flat tensors.
``metadata.json`` records the layout, every parameter's global shape and TP split dimension, the
data position, loss scaler and checksums. Parameter names are canonical (global layer numbers),
so a pipeline stage split does not change them.

Loading into another layout assembles one full parameter at a time from the slices that hold it
(memory bounded by the largest tensor), cuts out the new rank's TP slice, and hands the ZeRO
optimizer the element ranges of its new partition -- DeepSpeed users' most up-voted missing
feature (a direct load with a new DP size).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from zerotron.model.config import GPT2_ARCH
from zerotron.model.gpt import WORD_EMBEDDING
from zerotron.parallel.shard_info import shard_info
from zerotron.parallel import faults
from zerotron.checkpoint.agree import agree
from zerotron.checkpoint.schema import TOKENIZER_DIR, TOKENIZER_FILE, seal
from zerotron.checkpoint.files import (FORMAT_VERSION, OWNER, CheckpointError, ShardReader, atomic_write_bytes,
                                             atomic_write_json, prune, read_metadata, resolve_load_path, step_dir,
                                             write_shard)

MODEL_FIELDS = ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_length")


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


def canonical_names(model: torch.nn.Module) -> dict[str, str]:
    """Local parameter name -> layout-independent name (the model may define ``global_name``)."""
    fn = getattr(model, "global_name", None)
    return {n: (fn(n) if fn else n) for n, _ in model.named_parameters()}


def _param_info(model, opt, grid) -> dict[str, dict]:
    """Global shape and TP split dimension of every parameter, from its ``ShardInfo``.

    Checked against the optimizer's TP-local shapes, so a ``ShardInfo`` that does not describe
    the tensor actually held fails here rather than when another layout loads the checkpoint.
    """
    shapes = opt.param_shapes  # TP-local shapes; a frozen parameter is not rebound, its own shape holds
    names = canonical_names(model)
    info = {}
    for name, p in model.named_parameters():
        si = shard_info(p, name)
        local = tuple(shapes.get(name, p.shape))
        if si.local_shape(grid.tp_size) != local:
            raise CheckpointError(f"parameter {name!r} is {list(local)} on this rank but its ShardInfo {si} "
                                  f"gives {list(si.local_shape(grid.tp_size))} at TP size {grid.tp_size}; "
                                  f"fix the ShardInfo where the parameter is created")
        info[names[name]] = {"global_shape": list(si.global_shape), "tp_split_dim": si.tp_split_dim}
    return info


def shard_contents(model, opt, grid, rng_states: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """What this rank's shard holds: its tensors (fp32 masters and moments, RNG states), the
    metadata that places them (``index``, every parameter's global shape) and the optimizer's
    ``partition_state``. The dry run writes the metadata alone, from the same function the save uses."""
    names = canonical_names(model)
    state = opt.partition_state()
    index = [[names[n], grid.tp_rank, int(s), int(e), int(off)] for n, s, e, off in opt.partition_index()]
    tensors = {k: state[k] for k in ("master", "exp_avg", "exp_avg_sq")}
    tensors.update({f"rng/{k}": v for k, v in rng_states.items()})
    meta = {"rank": grid.rank, "coords": grid.coords, "index": index, "params": _param_info(model, opt, grid)}
    return tensors, meta, state


def save_checkpoint(save: str, step: int, model, opt, grid, *, consumed_samples: int, model_config: dict,
                    run_config: dict, rng_states: dict[str, torch.Tensor], run_id: str, keep_last: int = 2,
                    tokenizer: str | None = None) -> Path:
    """Write the checkpoint of ``step`` collectively; returns its directory (on every rank).

    ``run_id`` goes into the metadata (and into the ``.tmp`` directory while it is written), so
    pruning deletes only checkpoints this run wrote. ``tokenizer``: the run's sentencepiece model,
    kept in the checkpoint (``_keep_tokenizer``). The three phases are separate functions so
    ``async_save.py`` can run the middle one on a writer thread and the collective ones here.
    """
    tmp = open_checkpoint(save, step, grid, run_id, opt.device)
    tensors, meta, state = shard_contents(model, opt, grid, rng_states)
    header = checkpoint_header(step, opt, grid, state, consumed_samples=consumed_samples,
                               model_config=model_config, run_config=run_config, run_id=run_id)
    error = write_own_shard(tmp, step, grid, tensors, meta)
    return commit_checkpoint(save, tmp, error, grid, opt.device, header, keep_last=keep_last,
                             tokenizer=tokenizer)


def open_checkpoint(save: str, step: int, grid, run_id: str, device: torch.device) -> Path:
    """Collective: rank 0 makes the empty ``step_XXXXXXXX.tmp`` (naming its run); returns it."""
    tmp = step_dir(save, step).with_name(step_dir(save, step).name + ".tmp")
    error = None  # an OSError (full disk, quota, ...) stops every rank together: checkpoint_agree
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


def check_compatible(meta: dict, model_config: dict, names: dict[str, str]) -> None:
    """Raise (on every rank, before any collective) if the checkpoint's model differs from ours."""
    saved = meta.get("model", {})
    arch = {k: saved.get(k, v) for k, v in GPT2_ARCH.items()}  # a field it lacks: GPT-2's
    ours = {k: model_config.get(k, v) for k, v in GPT2_ARCH.items()}
    differ = [f"model.{k}={arch[k]!r} in the checkpoint, {ours[k]!r} in this run"
              for k in GPT2_ARCH if arch[k] != ours[k]]
    if differ:
        family = "gpt2" if arch == GPT2_ARCH else "llama"  # derived: a label could disagree
        raise CheckpointError(f"checkpoint holds another architecture ({family}): "
                              f"{', '.join(differ)}; load a checkpoint of this architecture or set "
                              f"those fields to the checkpoint's")
    for key in MODEL_FIELDS:
        if key in saved and key in model_config and saved[key] != model_config[key]:
            raise CheckpointError(f"checkpoint is of another model: model.{key}={saved[key]} in the checkpoint, "
                                  f"{model_config[key]} in this run; load a checkpoint of this model or change "
                                  f"model.{key}")
    missing = sorted(set(names.values()) - set(meta["params"]))
    if missing:
        raise CheckpointError(f"checkpoint lacks parameters {missing[:4]}{'…' if len(missing) > 4 else ''}; "
                              f"it was written by a different model")


class _Assembler:
    """Builds this rank's TP-local slice of one parameter from the old layout's shards, one at a time."""

    def __init__(self, meta: dict, reader: ShardReader, grid, dtype: torch.dtype = torch.float32):
        self.meta, self.reader, self.grid, self.dtype = meta, reader, grid, dtype
        self.old_tp = meta["layout"]["tp"]
        self.sources: dict[str, list] = {}
        for filename, entry in meta["files"].items():
            for canon, tp_rank, start, end, offset in entry["index"]:
                self.sources.setdefault(canon, []).append((filename, tp_rank, start, end, offset))
        self._key, self._value = None, None

    def local(self, canon: str, key: str, new_shape: list[int], dim: int | None) -> torch.Tensor:
        if self._key == (canon, key):
            return self._value
        info = self.meta["params"][canon]
        glob_shape = info["global_shape"]
        parts = []
        for r in range(self.old_tp if dim is not None else 1):
            local_shape = list(glob_shape)
            if dim is not None:
                local_shape[dim] //= self.old_tp
            numel = int(torch.tensor(local_shape).prod()) if local_shape else 1
            flat = torch.empty(numel, dtype=self.dtype)
            covered = torch.zeros(numel, dtype=torch.bool)
            for filename, tp_rank, start, end, offset in self.sources.get(canon, []):
                if dim is not None and tp_rank != r:
                    continue
                flat[start:end] = self.reader.read(filename, key, offset, offset + end - start).to(self.dtype)
                covered[start:end] = True
            if not bool(covered.all()):
                raise CheckpointError(f"checkpoint is incomplete: {canon} ({key}) of TP rank {r} is not fully "
                                      f"covered by its shards")
            parts.append(flat.view(local_shape))
        full = torch.cat(parts, dim=dim) if dim is not None else parts[0]
        new_global = list(new_shape)
        if dim is not None:
            new_global[dim] *= self.grid.tp_size
        full = _fit(full, new_global, canon)
        if dim is not None:
            full = full.chunk(self.grid.tp_size, dim=dim)[self.grid.tp_rank]
        self._key, self._value = (canon, key), full.contiguous()
        return self._value


def check_shape(canon: str, saved: list[int], ours: list[int]) -> None:
    """Raise unless a checkpoint's global shape of ``canon`` fits ours. Only the word embedding's
    (and an untied output layer's) rows may differ: the vocabulary padding depends on the TP
    size. Any other difference (a
    position table or MLP of another size) is another model, which cropping or zero-padding
    would load in silence."""
    saved, ours = list(saved), list(ours)
    vocab_rows = canon in (WORD_EMBEDDING, "output_layer")  # both padded to the TP size
    if saved == ours or (vocab_rows and len(saved) == len(ours) and saved[1:] == ours[1:]):
        return
    raise CheckpointError(f"checkpoint is of another model shape: {canon} is {saved} in the checkpoint but {ours} "
                          f"in this model; load a checkpoint of this model")


def _fit(t: torch.Tensor, shape: list[int], canon: str) -> torch.Tensor:
    """Crop or zero-pad the word embedding's padding rows, which the TP size may change."""
    if list(t.shape) == shape:
        return t
    check_shape(canon, list(t.shape), shape)
    out = t.new_zeros(shape)
    n = min(shape[0], t.shape[0])
    out[:n] = t[:n]
    return out


def load_checkpoint(load: str, model, opt, grid, *, model_config: dict, log: Callable[[str], None] = print,
                    verified: set[str] | frozenset = frozenset()) -> dict[str, Any]:
    """Load ``load`` (a checkpoint or a save directory) into ``model``/``opt`` in the current layout.

    ``verified``: shard files whose checksums were already checked (``resume.plan_resume``).
    Returns ``{"step", "consumed_samples", "rng" (dict or None when the layout changed), "path"}``.
    """
    path, notes = resolve_load_path(load)
    for note in notes:
        log(f"[checkpoint] {note}")
    meta = read_metadata(path)
    names = canonical_names(model)
    check_compatible(meta, model_config, names)
    reader = ShardReader(path, meta["files"], verified)
    # the optimizer's master dtype: a float64 run reshards its float64 state without rounding it
    assembler = _Assembler(meta, reader, grid, opt.master_dtype)
    params = dict(model.named_parameters())
    shapes = opt.param_shapes  # TP-local shapes; a frozen parameter is not rebound, its own shape holds
    for name, p in params.items():  # slices are cut along this dimension in both layouts
        saved_info, si = meta["params"][names[name]], shard_info(p, name)
        check_shape(names[name], saved_info["global_shape"], si.global_shape)  # every rank, before a collective
        saved, ours = saved_info["tp_split_dim"], si.tp_split_dim
        if saved != ours:
            raise CheckpointError(f"{names[name]} is TP-split along dimension {saved} in the checkpoint but "
                                  f"{ours} in this model; load a checkpoint of this model")

    def read_fn(name: str, key: str, start: int, end: int) -> torch.Tensor:
        p = params[name]
        shape = list(shapes.get(name, p.shape))
        return assembler.local(names[name], key, shape, shard_info(p, name).tp_split_dim).reshape(-1)[start:end]

    opt.load_partition_state(read_fn, step=meta.get("adam_step", meta["step"]), loss_scaler=meta.get("loss_scaler"))
    layout = meta["layout"]
    same_layout = ((layout["tp"], layout["pp"], layout["dp"], layout.get("cp", 1),  # v moves layers
                    layout.get("virtual_stages", 1))
                   == (grid.tp_size, grid.pp_size, grid.dp_size, grid.cp_size, getattr(grid.dims, "virtual_stages", 1)))
    rng = None
    if same_layout:  # RNG streams belong to ranks; after a layout change the trainer reseeds instead
        rng = reader.tensors_with_prefix(f"rank_{grid.rank:05d}.safetensors", "rng/")
    log(f"[checkpoint] loaded {path} (step {meta['step']}, layout tp={layout['tp']} pp={layout['pp']} "
        f"dp={layout['dp']} cp={layout.get('cp', 1)} stage={layout['stage']}{'' if same_layout else ' -> resharded'})")
    return {"step": meta["step"], "consumed_samples": meta["consumed_samples"], "rng": rng, "path": str(path)}
