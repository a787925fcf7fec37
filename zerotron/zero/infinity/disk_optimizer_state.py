"""ZeRO-Infinity: the fp32 optimizer state of the partition on local disk, Adam streamed tile by tile.

ZeRO-Infinity (Rajbhandari et al., arXiv 2104.07857) adds an NVMe tier below ZeRO-Offload's host
memory: the Pos state (fp32 master weights and both Adam moments, 12 of the 16 bytes per parameter)
lives in files, so the accelerator -- and the host -- hold only the parameter and gradient
partitions (stage 3: 2Ψ/Nd + 2Ψ/Nd in 16-bit) plus ``buffer_count`` tiles of ``sub_group_size``
elements. The step walks the partition in tiles: while tile i is updated, tile i+1 is read ahead
and tile i-1 is written behind (``DiskTensorStore``), so the disk streams while the CPU computes.

One file holds the three states tile-major (tile [a, b) at [3a, 3b): master, exp_avg, exp_avg_sq),
so one buffer slot is one tile and ``buffer_count`` bounds the tiles in memory exactly as
DeepSpeed's ``offload_optimizer.buffer_count`` does. AdamW is elementwise, so updating tile by
tile gives bit-for-bit the values of the in-memory step.

Checkpoints: ``master``/``exp_avg``/``exp_avg_sq`` read the whole partition from disk into a
cache (writes into it, from ``load_partition_state``, are committed to disk before the next step).
Each updated master tile goes straight to the stage-3 parameters through their ``ShardSource``
(``write``): into the partition in memory, or written behind to the parameter file when
``offload_param`` is on NVMe too (``disk_params``) -- this file's master stays the source of truth.
"""

from __future__ import annotations

import shutil
import weakref

import torch

from zerotron.parallel import host_sync
from zerotron.zero.clip import apply_coef
from zerotron.zero.infinity.disk_store import DiskTensorStore, rank_directory
from zerotron.zero.optimizer_state import coef_for

KEYS = ("master", "exp_avg", "exp_avg_sq")


def expected_infinity_bytes(psi: int, dp: int, param_bytes: int = 2, k: int = 12, offload_param: bool = False) -> dict:
    """Stage 3 + NVMe optimizer offload per rank: what stays in (device) memory and what goes to disk.

    ``offload_param``: the parameter partition (param_bytes·Ψ/Nd) leaves memory too, into an fp32 file."""
    if offload_param:
        return {"device": param_bytes * psi / dp, "disk": (k + 4) * psi / dp}
    return {"device": 2 * param_bytes * psi / dp, "disk": k * psi / dp}


class DiskOptimizerState:
    """``OptimizerStateStore`` (``zero.strategies``) whose master and moments live in one file per rank."""

    def __init__(self, numel: int, directory: str, rank: int, tile: int, buffer_count: int, params,
                 pin: bool = False):
        self.dir = rank_directory(directory, f"zerotron_rank{rank}_")
        self.numel, self.tile = numel, max(1, min(tile, numel))
        self.store = DiskTensorStore(self.dir, buffer_count=buffer_count)
        self.store.create("state", torch.zeros(3 * numel))
        # one tile of the reduced gradient in host memory: the host Adam cannot read device memory
        self.grad_stage = torch.empty(self.tile, pin_memory=pin)
        self.params = params  # the stage-3 ShardSource: where each updated master tile is published
        self.step = 0
        self.device = torch.device("cpu")
        self.cache: dict[str, torch.Tensor] = {}
        self.decay: list[tuple[int, int]] = []  # partition coordinates, set by ``attach``
        self.layout = None
        self._finalizer = weakref.finalize(self, _cleanup, self.store, self.dir)

    def tiles(self):
        for a in range(0, self.numel, self.tile):
            yield a, min(a + self.tile, self.numel)

    def attach(self, layout, decay_segments: list, param_shards: list) -> None:
        """Decay ranges in partition coordinates."""
        self.layout = layout
        for c in layout.chunks:
            self.decay += [(c.part_offset + a, c.part_offset + b) for a, b in decay_segments[c.index]]

    @property
    def masters(self) -> "_LazyMasters":
        """Chunk shards of the master, read when asked (``full_params``); made per use, so no
        reference cycle keeps this object -- and its files -- alive past the optimizer."""
        return _LazyMasters(self, self.layout)

    # whole-partition views (init, checkpoints, full_params) -------------------------------------
    def _read_range(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of state ``key``, read tile by tile from its third of each tile."""
        out, i = torch.empty(hi - lo), KEYS.index(key)
        for a, b in self.tiles():
            s, e = max(a, lo), min(b, hi)
            if s < e:
                base = 3 * a + i * (b - a)
                out[s - lo:e - lo] = self.store._read("state", base + s - a, base + e - a)
        return out

    def _materialize(self, key: str) -> torch.Tensor:
        if key not in self.cache:
            self.cache[key] = self._read_range(key, 0, self.numel)
        return self.cache[key]

    master = property(lambda self: self._materialize("master"))
    exp_avg = property(lambda self: self._materialize("exp_avg"))
    exp_avg_sq = property(lambda self: self._materialize("exp_avg_sq"))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {key: self._materialize(key) for key in KEYS}

    def part_slice(self, key: str, off: int, n: int) -> torch.Tensor:
        return self._materialize(key)[off:off + n]

    def commit(self) -> None:
        """Write cached (possibly modified) whole-partition tensors back to disk and drop them."""
        if not self.cache:
            return
        writes = []
        for a, b in self.tiles():
            buf = self.store.read_ahead("state", 3 * a, 3 * b).result().view(3, b - a)
            for i, key in enumerate(KEYS):
                if key in self.cache:
                    buf[i] = self.cache[key][a:b]
            writes.append(self.store.write_behind("state", 3 * a, buf.view(-1)))
        for w in writes:
            w.result()
        self.cache.clear()

    def read_master(self, lo: int, hi: int) -> torch.Tensor:
        """Master elements ``[lo, hi)`` (for ``full_params``), from the cache or the disk."""
        return self.cache["master"][lo:hi] if "master" in self.cache else self._read_range("master", lo, hi)

    def fresh(self, c) -> torch.Tensor | None:
        """The step publishes every tile itself; only a master loaded into the cache is still unpublished."""
        return self.cache["master"][c.part_offset:c.part_offset + c.shard] if "master" in self.cache else None

    # the step -----------------------------------------------------------------------------------
    def update(self, grads, adamw, coef: torch.Tensor | float) -> None:
        """AdamW over the partition, tile by tile: read i+1 ahead, update i, write i-1 behind.

        Each gradient tile is copied into the host staging tile (fp32) first: the reduced gradients
        live on the device and the Adam here runs on the host, as ZeRO-Offload's does. The device
        coefficient is read once per step (``coef_for``), not per tile."""
        self.commit()
        coef = coef_for(coef, self.device)
        tiles = list(self.tiles())
        reads = [self.store.read_ahead("state", 3 * tiles[0][0], 3 * tiles[0][1])]
        writes = []
        for i, (a, b) in enumerate(tiles):
            buf = reads.pop(0).result().view(3, b - a)
            if i + 1 < len(tiles):  # read ahead (blocks only when buffer_count tiles are in memory)
                reads.append(self.store.read_ahead("state", 3 * tiles[i + 1][0], 3 * tiles[i + 1][1]))
            master, exp_avg, exp_avg_sq = buf[0], buf[1], buf[2]
            grad = self._stage(grads.grad_range(a, b), coef)
            segs = [(max(s, a) - a, min(e, b) - a) for s, e in self.decay if s < b and e > a]
            adamw(master, grad, exp_avg, exp_avg_sq, segs)
            self.params.write(a, master)
            writes.append(self.store.write_behind("state", 3 * a, buf.view(-1)))  # frees the slot when done
        for w in writes:
            w.result()

    def _stage(self, grad: torch.Tensor, coef) -> torch.Tensor:
        """``grad`` (a reduced-gradient tile) as fp32 host memory, scaled by ``coef``; an fp32 host
        tile is scaled in place (it is consumed by this step and zeroed after it)."""
        if grad.device != self.device or grad.dtype != torch.float32:
            grad = self.grad_stage[:grad.numel()].copy_(grad)  # blocking: the host Adam reads it
        return apply_coef(grad, coef)

    # accounting -----------------------------------------------------------------------------------
    def resident(self) -> list[torch.Tensor]:
        # tiles in flight belong to the disk store's buffers
        return list(self.cache.values()) + [self.grad_stage]

    def memory_report(self) -> dict:
        return {"disk": {"master_fp32": 4 * self.numel, "optimizer_moments": 2 * 4 * self.numel},
                "host": {"fixed_buffers": (self.store.buffer_count * 3 + 1) * 4 * self.tile,
                         "pinned_rounding": host_sync.pinned_rounding([self.grad_stage])}}

    def io_report(self) -> dict:
        return {"read": self.store.bytes_read, "written": self.store.bytes_written}


class _LazyMasters:
    """``opt.masters[c]``: chunk ``c``'s master shard, read from disk when asked (``full_params``)."""

    def __init__(self, state, layout):
        self.state, self.layout = state, layout

    def __getitem__(self, ci: int) -> torch.Tensor:
        c = self.layout.chunks[ci]
        return self.state.read_master(c.part_offset, c.part_offset + c.shard)

    def __len__(self) -> int:
        return len(self.layout.chunks)

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def _cleanup(store, directory) -> None:
    try:
        store.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
