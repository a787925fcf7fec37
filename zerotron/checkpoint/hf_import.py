"""``--init-from-hf DIR``: a transformers model's weights into this rank's ZeRO partition.

Each rank opens the safetensors files (one, or the shards ``model.safetensors.index.json`` maps)
and reads, with ``safe_open(...).get_slice``, only the rows its TP x PP slice and its ZeRO
partition of the fp32 master weights hold (``hf_weights.pieces``); the optimizer's moments start
at zero and its step at 0. The files are untrusted: every tensor the model needs is checked for
presence, shape and a floating dtype, naming the tensor, before anything is read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from zerotron.config.run_config import ConfigError
from zerotron.checkpoint.hf_weights import BUFFERS, Piece, expected_tensors, pieces

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
FLOATS = {"F32", "F16", "BF16", "F64"}


def _error(directory, what: str) -> ConfigError:
    return ConfigError(f"checkpoint.init_from_hf={directory}: {what}")


class HFTensors:
    """The tensors of a model directory by name, opened lazily, read a slice at a time."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise _error(directory, f"{INDEX} is not a safetensors index ({e!r})") from None
            if not isinstance(weight_map, dict):
                raise _error(directory, f"{INDEX}: weight_map is not an object")
        elif (self.directory / SINGLE).is_file():
            weight_map = None
        else:
            raise _error(directory, f"neither {SINGLE} nor {INDEX} is there; save the model with "
                                    f"save_pretrained(..., safe_serialization=True)")
        files = {SINGLE} if weight_map is None else set(weight_map.values())
        for name in files:
            if not isinstance(name, str) or Path(name).name != name or \
                    not (self.directory / name).is_file():
                raise _error(directory, f"{INDEX} names shard {name!r}, which is not a file in "
                                        f"the directory")
        self._handles: dict[str, object] = {}
        self.where: dict[str, str] = {}
        for name in sorted(files):
            for key in self._open(name).keys():
                self.where[key] = name
        if weight_map is not None:
            wrong = sorted(k for k, f in weight_map.items() if self.where.get(k) != f)
            if wrong:
                raise _error(directory, f"{INDEX} maps {wrong[0]} to {weight_map[wrong[0]]}, "
                                        f"which does not hold it")

    def _open(self, filename: str):
        from safetensors import safe_open

        if filename not in self._handles:
            try:
                self._handles[filename] = safe_open(str(self.directory / filename), "pt")
            except Exception as e:  # safetensors raises its own error types for a bad header
                raise _error(self.directory,
                             f"{filename} is not a safetensors file ({e})") from None
        return self._handles[filename]

    def close(self) -> None:
        """Unmap every file: the pages read so far leave this process's resident memory."""
        self._handles.clear()

    def slice(self, name: str):
        return self._open(self.where[name]).get_slice(name)

    def check(self, expected: dict[str, list[int]]) -> None:
        """Every expected tensor there, of its shape and a floating dtype; nothing unexpected."""
        for name, shape in expected.items():
            if name not in self.where:
                raise _error(self.directory, f"tensor {name} is missing (expected {shape})")
            sl = self.slice(name)
            got, dtype = list(sl.get_shape()), sl.get_dtype()
            if got != shape:
                raise _error(self.directory, f"tensor {name} is {got}, but config.json gives "
                                             f"{shape}")
            if dtype not in FLOATS:
                raise _error(self.directory, f"tensor {name} is {dtype}; weights must be one of "
                                             f"{sorted(FLOATS)}")
        extra = sorted(k for k in self.where if k not in expected and not k.endswith(BUFFERS))
        if extra:
            raise _error(self.directory, f"tensor {extra[0]} (and {len(extra) - 1} more) is not "
                                         f"part of the model config.json describes; zerotron "
                                         f"would not train it")

    def rows(self, piece: Piece, start: int, end: int, width: int, dtype) -> torch.Tensor:
        """Rows ``[start, end)`` of ``piece`` (counted in zerotron's rows), as ``[n, width]``."""
        if piece.hf is None:
            return torch.zeros(end - start, width, dtype=dtype)
        if piece.interleave:  # gate/up pairs: read the pairs covering the range, then trim
            j0, j1 = start // 2, (end + 1) // 2
            a = piece.rows[0]
            pair = [self._read(n, piece, a + j0, a + j1, dtype)
                    for n in (piece.hf, piece.interleave)]
            both = torch.stack(pair, dim=1).reshape(-1, width)
            return both[start - 2 * j0:end - 2 * j0]
        a = piece.rows[0]
        return self._read(piece.hf, piece, a + start, a + end, dtype).reshape(-1, width)

    def _read(self, name: str, piece: Piece, r0: int, r1: int, dtype) -> torch.Tensor:
        """The rows (columns) asked for, copied out of safetensors' view, which lies in the
        file's mapping (storage the size of the whole tensor; only the slice's pages read)."""
        sl = self.slice(name)
        if len(sl.get_shape()) == 1:
            return sl[r0:r1].to(dtype, copy=True)
        c0, c1 = piece.cols or (0, sl.get_shape()[0 if piece.transposed else 1])
        if piece.transposed:
            return sl[c0:c1, r0:r1].to(dtype, copy=True).t()
        return sl[r0:r1, c0:c1].to(dtype, copy=True)


BLOCK = 1 << 18  # elements read at a time: a rank's temporary is this, never a whole parameter


def fill_range(reader: HFTensors, plan: list[Piece], shape: list[int], start: int, end: int,
               out: torch.Tensor) -> torch.Tensor:
    """Write elements ``[start, end)`` of the flattened TP-local parameter ``plan`` builds into
    ``out``, a block of rows at a time; returns ``out``."""
    width = 1
    for n in shape[1:]:
        width *= n
    step = max(1, BLOCK // width)
    for r0 in range(start // width, -(-end // width), step):
        r1 = min(r0 + step, -(-end // width))
        parts, at = [], 0
        for piece in plan:  # the pieces' rows that fall in [r0, r1)
            lo, hi = max(r0, at), min(r1, at + piece.length)
            if lo < hi:
                parts.append(reader.rows(piece, lo - at, hi - at, width, out.dtype))
            at += piece.length
        rows = (torch.cat(parts) if len(parts) > 1 else parts[0]).reshape(-1)
        a, b = max(start, r0 * width), min(end, r1 * width)  # elements of this block we hold
        out[a - start:b - start].copy_(rows[a - r0 * width:b - r0 * width])
    return out


def load_hf_weights(directory: str, family: str, model, opt, grid, mcfg) -> None:
    """Fill this rank's partition of the fp32 masters from ``directory``; moments zero, step 0.

    The rows are copied straight into the master partition (``part_slice``), which the
    optimizer's own copy then finds in place; the moments are a zero that allocates nothing.
    The files are closed after each range, so the pages a rank mapped are only those it read.
    """
    from zerotron.parallel.shard_info import shard_info
    from zerotron.checkpoint.distributed import canonical_names

    reader = HFTensors(directory)
    reader.check(expected_tensors(mcfg, family))
    names, params, shapes = canonical_names(model), dict(model.named_parameters()), opt.param_shapes
    offsets = {(n, s, e): off for n, s, e, off in opt.partition_index()}
    plans: dict[str, list[Piece]] = {}

    def read_fn(name: str, key: str, start: int, end: int) -> torch.Tensor:
        if key != "master":  # Adam's moments: a fresh optimizer
            return torch.zeros((), dtype=opt.master_dtype).expand(end - start)
        shape = list(shapes.get(name, params[name].shape))
        if name not in plans:
            plans[name] = pieces(names[name], mcfg, family, grid.tp_size, grid.tp_rank)
            rows = sum(p.length for p in plans[name])
            if rows != shape[0] or shard_info(params[name], name).global_shape is None:
                raise ConfigError(f"{names[name]}: {rows} rows from {directory}, {shape[0]} in "
                                  f"the model; the import plan does not fit this parameter")
        out = opt.state.part_slice("master", offsets[(name, start, end)], end - start)
        fill_range(reader, plans[name], shape, start, end, out)
        reader.close()
        return out

    opt.load_partition_state(read_fn, step=0)


def start_run(run) -> dict:
    """A run's ``--init-from-hf`` (``training/build_run.py: load``): import unless a checkpoint
    is resumed (a restarted job continues its own); returns ``{"hf_model_type": ...}`` for
    metadata.json ({} for none), which ``convert_checkpoint.py --hf`` reads to write the same
    transformers class back."""
    from zerotron.checkpoint.files import read_metadata
    from zerotron.config.hf_config import read_hf_config

    cfg, resumed = run.cfg, run.checkpointer.plan.path
    if resumed is not None:
        if cfg.checkpoint.init_from_hf:
            run.log(f"[hf] checkpoint.init_from_hf={cfg.checkpoint.init_from_hf} is not read: "
                    f"the run continues {resumed}")
        saved = read_metadata(resumed).get("model", {}).get("hf_model_type")
        return {"hf_model_type": saved} if saved else {}
    if not cfg.checkpoint.init_from_hf:
        return {}
    hf = read_hf_config(cfg.checkpoint.init_from_hf, run.mcfg.seq_length)
    load_hf_weights(cfg.checkpoint.init_from_hf, hf.model_type, run.model, run.opt,
                    run.grid, run.mcfg)
    run.log(f"[hf] initialised from {cfg.checkpoint.init_from_hf} ({hf.architecture}); "
            f"optimizer fresh at step 0")
    return {"hf_model_type": hf.model_type}


def check_directory(cfg, mcfg) -> None:
    """Before any process group: the tensors the model needs are all there, of their shapes."""
    from zerotron.config.hf_config import read_hf_config

    hf = read_hf_config(cfg.checkpoint.init_from_hf, mcfg.seq_length)
    HFTensors(hf.directory).check(expected_tensors(mcfg, hf.model_type))
