"""The one factory of ZeroOptimizer's strategies (``strategies``): which shard source, gather,
reduce-scatter and optimizer-state store a ``ZeroConfig`` selects.

It is the only code that reads ZeRO's feature keys (offload, NVMe, ZeRO++), so the core keeps one
code path whatever is enabled. It sits above both ``strategies`` (the plain implementations) and
``zeropp.strategies`` (ZeRO++'s, which build on the plain gather), so neither imports the other's
package back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerotron.parallel import host_sync, runtime
from zerotron.zero.host_params import HostParams
from zerotron.zero.infinity.disk_optimizer_state import DiskOptimizerState
from zerotron.zero.infinity.disk_params import DiskParams
from zerotron.zero.optimizer_state import OptimizerState
from zerotron.zero.strategies import (Gather, MemoryShards, OptimizerStateStore, PlainGather,
                                      PlainReduceScatter, ReduceScatter, ShardSource)
from zerotron.zero.zeropp.groups import SecondaryPartition, check_node_local, node_groups
from zerotron.zero.zeropp.strategies import QuantizedGather, QuantizedReduceScatter, SecondaryGather


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
    dp = grid.dp_cp_group
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
