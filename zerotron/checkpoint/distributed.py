"""Distributed checkpoints that resume exactly and load into any other TP / PP / DP / ZeRO layout.

Each rank writes one shard: its flat fp32 (fp64 in precision fp64) partitions of the ZeRO
optimizer (master weights, Adam moments) and its RNG states. The shard's index says, for every
parameter slice it holds, ``(name, tp_rank, start, end, offset)``: elements ``[start, end)`` of
that TP rank's flattened parameter live at ``offset`` of the shard's flat tensors.
``metadata.json`` records the layout, every parameter's global shape and TP split dimension, the
data position, loss scaler and checksums. Parameter names are canonical (global layer numbers),
so a pipeline stage split does not change them.

The save itself (open, write, commit) is ``write.py``'s; this module says what a shard holds and
how it loads. Loading into another layout assembles one full parameter at a time from the slices that hold it
(memory bounded by the largest tensor), cuts out the new rank's TP slice, and hands the ZeRO
optimizer the element ranges of its new partition -- DeepSpeed users' most up-voted missing
feature (a direct load with a new DP size).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from zerotron.model.config import GPT2_ARCH
from zerotron.model.gpt import WORD_EMBEDDING
from zerotron.parallel.shard_info import shard_info
from zerotron.checkpoint.files import CheckpointError, ShardReader, read_metadata, resolve_load_path

MODEL_FIELDS = ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_length")


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
