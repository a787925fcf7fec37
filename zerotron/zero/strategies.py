"""The seams of ZeroOptimizer: four strategy protocols, their plain implementations, one factory.

ZeRO-DP (arXiv 1910.02054 §5) fixes *what* each rank partitions. ZeRO-Offload, ZeRO-Infinity
(arXiv 2104.07857) and ZeRO++ (arXiv 2306.10209) change *where* a partition lives and *how* it
crosses the wire -- four independent choices, each behind one small protocol, so the core
(``optimizer``, ``grad_reduce``, ``stage3``) keeps a single code path whatever is enabled:

* ``ShardSource`` -- where stage 3 reads a group's parameter shard just before its all-gather:
  memory (``MemoryShards``), host memory (``host_params.HostParams``) or a file
  (``infinity.disk_params.DiskParams``, Infinity §5-6).
* ``Gather`` -- how a stage-3 group is all-gathered: ``PlainGather`` (ZeRO §5.3), qwZ
  (``zeropp.strategies.QuantizedGather``, ZeRO++ §3.1) or hpZ (``SecondaryGather``, §3.2).
* ``ReduceScatter`` -- how a gradient bucket of stages 1-3 reaches its owners:
  ``PlainReduceScatter`` (ZeRO §5.2) or qgZ (``zeropp.strategies.QuantizedReduceScatter``, §3.3).
* ``OptimizerStateStore`` -- where the fp32 master and the Adam moments live and how AdamW runs
  over them: device or host memory (``optimizer_state.OptimizerState``, ZeRO-Offload) or disk
  tiles (``infinity.disk_optimizer_state.DiskOptimizerState``, Infinity §5).

``build`` is the only code that reads the feature keys of ``ZeroConfig``. Every strategy reports
its own bytes by place -- ``memory_report() -> {"device" | "host" | "disk": {kind: bytes}}`` with
the kinds of ``accounting.memory_report`` -- and the disk ones their traffic (``io_report``), so
accounting adds reports up instead of knowing which features exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from zerotron.parallel import collectives as C
from zerotron.parallel import host_sync, runtime
from zerotron.zero.host_params import HostParams
from zerotron.zero.infinity.disk_optimizer_state import DiskOptimizerState
from zerotron.zero.infinity.disk_params import DiskParams
from zerotron.zero.optimizer_state import OptimizerState
from zerotron.zero.zeropp.groups import SecondaryPartition, check_node_local, node_groups

Report = dict  # {place: {kind: bytes}}; places "device", "host", "disk"


# protocols ----------------------------------------------------------------------------------------
class ShardSource(Protocol):
    """Where stage 3 reads a group's shard before its all-gather (ZeRO §5.3; Infinity §5-6: NVMe)."""

    def adopt(self, part: torch.Tensor) -> torch.Tensor:
        """Take the filled stage-3 partition; returns what stays in memory (it, or an empty tensor)."""

    def take(self, g: int) -> tuple[torch.Tensor, int]:
        """Group ``g``'s shard, and the partition offset of its first element."""

    def done(self, g: int) -> None:
        """The all-gather that read group ``g``'s shard has finished: the shard may go."""

    def read_ahead(self, groups: list[int]) -> None:
        """A hint: these groups are gathered next, after the gathers in flight."""

    def settle(self) -> None:
        """No gather until the next forward (the step may rewrite the partition)."""

    def write(self, lo: int, values: torch.Tensor) -> None:
        """Partition elements ``[lo, lo + n)`` := updated master ``values`` (rounded to the parameter dtype)."""

    def memory_report(self) -> Report: ...

    def io_report(self) -> dict: ...


class Gather(Protocol):
    """How a stage-3 group crosses the wire (ZeRO §5.3; ZeRO++ §3.1 qwZ, §3.2 hpZ)."""

    def gather(self, g: int, buf: torch.Tensor, source: ShardSource, backward: bool, async_op: bool) -> list:
        """Fill ``buf`` with group ``g``; returns the collective handles still in flight."""

    def complete(self, g: int, buf: torch.Tensor) -> None:
        """Group ``g``'s gather into ``buf`` has finished."""

    def invalidate(self) -> None:
        """The parameters changed (an optimizer step): whatever was derived from them is stale."""

    def memory_report(self) -> Report: ...


class ReduceScatter(Protocol):
    """How a gradient bucket of stages 1-3 reaches its owners (ZeRO §5.2; ZeRO++ §3.3 qgZ)."""

    def reduce_scatter(self, out: torch.Tensor, bucket: torch.Tensor, async_op: bool) -> C.Handle:
        """``out`` := this rank's shard of the sum over DP of ``bucket`` (already divided by the DP size)."""


class GradShards(Protocol):
    """What a step reads from the gradient reducer: per chunk, or a partition range across chunks."""

    def grad_shard(self, c) -> torch.Tensor: ...

    def grad_range(self, lo: int, hi: int) -> torch.Tensor: ...


AdamW = Callable[..., None]  # (master, grad, exp_avg, exp_avg_sq, decay_segments): one AdamW update


class OptimizerStateStore(Protocol):
    """This rank's Pos state (ZeRO §5.1). ``step`` counts the applied steps, ``device`` is where the
    AdamW math runs, ``masters[c]`` is chunk ``c``'s master shard (for ``full_params``)."""

    step: int
    device: torch.device
    masters: Sequence[torch.Tensor]

    def attach(self, layout, decay_segments: list, param_shards: list[torch.Tensor]) -> None:
        """Bind to the layout (``param_shards[c]``: chunk ``c``'s shard of the parameter storage)."""

    def part_slice(self, key: str, off: int, n: int) -> torch.Tensor:
        """Writable elements ``[off, off + n)`` of state ``key`` (never across chunks)."""

    def commit(self) -> None:
        """Writes through ``part_slice`` take effect before the next ``update``."""

    def update(self, grads: GradShards, adamw: AdamW, coef: torch.Tensor | float) -> None:
        """One AdamW step over the partition, gradients scaled by ``coef``: a 0-dim tensor on the
        gradients' device (clipping on; reading it would sync the step) or a host float (off)."""

    def fresh(self, c) -> torch.Tensor | None:
        """Chunk ``c``'s master shard if the parameters do not hold it yet, else None."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """``master``, ``exp_avg``, ``exp_avg_sq`` of the whole partition (checkpoints)."""

    def resident(self) -> list[torch.Tensor]:
        """The tensors this state holds in memory now (device or host), for a memory tracker."""

    def memory_report(self) -> Report: ...

    def io_report(self) -> dict: ...


# plain implementations ----------------------------------------------------------------------------
class MemoryShards:
    """The partition stays in memory: a shard is a view of it, there is nothing to read ahead."""

    def __init__(self):
        self.part: torch.Tensor | None = None

    def adopt(self, part: torch.Tensor) -> torch.Tensor:
        self.part = part
        return part

    def take(self, g: int) -> tuple[torch.Tensor, int]:
        return self.part, 0

    def done(self, g: int) -> None:
        pass

    def read_ahead(self, groups: list[int]) -> None:
        pass

    def settle(self) -> None:
        pass

    def write(self, lo: int, values: torch.Tensor) -> None:
        self.part[lo:lo + values.numel()].copy_(values)

    def memory_report(self) -> Report:
        return {"device": {"params": self.part.numel() * self.part.element_size()}}

    def io_report(self) -> dict:
        return {}


class PlainGather:
    """ZeRO §5.3: each chunk of the group all-gathered over DP from the owners' shards."""

    def __init__(self, layout, group):
        self.layout, self.group = layout, group

    def gather(self, g: int, buf: torch.Tensor, source: ShardSource, backward: bool, async_op: bool) -> list:
        return [C.all_gather(out, shard, self.group, async_op=async_op)
                for out, shard in self.layout.gather_pairs(g, buf, *source.take(g))]

    def complete(self, g: int, buf: torch.Tensor) -> None:
        pass

    def invalidate(self) -> None:
        pass

    def memory_report(self) -> Report:
        return {}


class PlainReduceScatter:
    """ZeRO §5.2: a bucket reduce-scattered over DP in the model dtype (Ψ per step)."""

    def __init__(self, group):
        self.group = group

    def reduce_scatter(self, out: torch.Tensor, bucket: torch.Tensor, async_op: bool) -> C.Handle:
        return C.reduce_scatter(out, bucket, self.group, async_op=async_op)


def merge_reports(*reports: Report) -> Report:
    """The sum of ``reports``, place by place and kind by kind."""
    out: Report = {}
    for report in reports:
        for place, kinds in report.items():
            for kind, n in kinds.items():
                out.setdefault(place, {})[kind] = out.get(place, {}).get(kind, 0) + n
    return out


# the factory --------------------------------------------------------------------------------------
@dataclass
class Strategies:
    state: OptimizerStateStore
    scatter: ReduceScatter
    shards: ShardSource | None = None  # stage 3 only
    gather: Gather | None = None       # stage 3 only


def build(cfg, grid, layout, dtype: torch.dtype, master_dtype: torch.dtype, device: torch.device,
          owner, grad_dtype: torch.dtype | None = None) -> Strategies:
    """The strategies ``cfg`` selects. Validates the ZeRO++ sizes against the DP size and the node
    (``LOCAL_WORLD_SIZE``; on every rank, before any collective), then creates the node-local
    groups (``Grid.split_group``: collective).
    ``owner``: the object whose lifetime the disk files follow; ``grad_dtype``: the reduced gradients'
    (default ``dtype``) -- in the master dtype on the device they need no fp32 staging buffer."""
    from zerotron.zero.zeropp.strategies import QuantizedGather, QuantizedReduceScatter, SecondaryGather

    dp = grid.dp_group
    cfg.validate(dp_size=dp.size)
    check_node_local(cfg, grid.dims, runtime.gpus_per_node())
    block = cfg.zero_quantization_block_size
    hpz, _ = node_groups(grid, cfg.zero_hpz_partition_size)
    scatter = PlainReduceScatter(dp)
    if cfg.zero_quantized_gradients:
        scatter = QuantizedReduceScatter(dp, block, *node_groups(grid, cfg.qgz_node_size))
    shards = gather = None
    if cfg.stage == 3:
        shards = MemoryShards()
        if cfg.offload_param_device == "cpu":
            shards = HostParams(layout)
        if cfg.offload_param_device == "nvme":
            shards = DiskParams(layout, cfg.offload_param_nvme_path, grid.rank,
                                             cfg.offload_param_buffer_count, owner=owner)
        gather = QuantizedGather(layout, dp, block) if cfg.zero_quantized_weights else PlainGather(layout, dp)
        if hpz is not None:
            gather = SecondaryGather(gather, SecondaryPartition(layout, hpz, grid.rank, dtype, device))
    if cfg.optimizer_offload == "nvme":
        state = DiskOptimizerState(layout.part_numel, cfg.offload_optimizer_nvme_path, grid.rank,
                                   cfg.optimizer_tile(max(layout.numels), dp.size), cfg.offload_optimizer_buffer_count,
                                   params=shards, pin=host_sync.pinned(device))
    else:
        # fp32 on the device: the parameters are the master weights (no 4-byte copy; K = 8, not 12),
        # except with the parameters on disk, whose file is derived from an authoritative master
        shared = dtype == master_dtype and cfg.optimizer_offload == "none" and cfg.offload_param_device == "none"
        staged = (grad_dtype or dtype) != master_dtype or cfg.optimizer_offload == "cpu"
        state = OptimizerState(layout.part_numel, max(c.shard for c in layout.chunks) if staged else 0, device,
                               cfg.optimizer_offload == "cpu", own_master=not shared, dtype=master_dtype)
    return Strategies(state, scatter, shards, gather)
