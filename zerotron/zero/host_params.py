"""``offload_param: {device: cpu}``: the stage-3 parameter partition in host memory, copied to the
device per unit just before its all-gather (DeepSpeed's ZeRO-Offload of parameters).

Between gathers a rank needs its shard of a unit only as the input of that unit's all-gather
(ZeRO §5.3), so the shard can live on the host -- pinned on CUDA, so the copy is asynchronous --
and the device holds only the units being gathered, the gradient partition and the optimizer's
buffers. After each step the updated master is written back into the host partition, rounded to
the parameter dtype (``write``), as ``infinity.disk_params`` does for the NVMe tier; the master
stays authoritative and checkpoints read it, never this copy.
"""

from __future__ import annotations

import torch

from zerotron.parallel import host_sync


class HostParams:
    """``ShardSource`` (``zero.strategies``): this rank's stage-3 partition on the host."""

    def __init__(self, layout):
        self.ranges = []  # per layout group: its [lo, hi) in the partition (its chunks are consecutive)
        for g in layout.groups:
            first, last = layout.chunks[g.chunks[0]], layout.chunks[g.chunks[-1]]
            self.ranges.append((first.part_offset, last.part_offset + last.shard))
        self.host: torch.Tensor | None = None
        self.taken: dict[int, torch.Tensor] = {}  # group -> its shard on the device while a gather reads it

    def adopt(self, part: torch.Tensor) -> torch.Tensor:
        """Move the initial partition to the host; what stays on the device is an empty tensor."""
        self.device, self.dtype = part.device, part.dtype
        self.pinned = host_sync.pinned(part.device)
        self.host = torch.empty(part.numel(), dtype=part.dtype, device="cpu", pin_memory=self.pinned)
        self.host.copy_(part)
        return torch.empty(0, dtype=part.dtype, device=part.device)

    def take(self, g: int) -> tuple[torch.Tensor, int]:
        """Group ``g``'s shard (partition elements ``[lo, hi)``) on the device, and ``lo``."""
        lo, hi = self.ranges[g]
        self.taken[g] = self.host[lo:hi].to(self.device, non_blocking=self.pinned)
        return self.taken[g], lo

    def done(self, g: int) -> None:
        self.taken.pop(g, None)

    def read_ahead(self, groups) -> None:
        pass  # a pinned copy is issued when the gather takes the shard: it is already asynchronous

    def settle(self) -> None:
        pass

    def write(self, lo: int, values: torch.Tensor) -> None:
        """Partition elements ``[lo, lo + n)`` := ``values`` (the updated master, rounded to the param dtype)."""
        self.host[lo:lo + values.numel()].copy_(values)

    def memory_report(self) -> dict:
        return {"host": {"params": self.host.numel() * self.host.element_size(),
                         "pinned_rounding": host_sync.pinned_rounding([self.host])}}

    def io_report(self) -> dict:
        return {}
