"""Where the fp32 optimizer state lives: on the accelerator, or on the host (ZeRO-Offload).

``OptimizerState`` is the in-memory ``OptimizerStateStore`` of ``zero.strategies``.

ZeRO-Offload moves the Pos state (fp32 master weights and both Adam moments, 12 of the 16 bytes
per parameter) and the Adam step itself to the CPU. Per step each rank copies its reduced
gradient shard device-to-host (as fp32) and its updated 16-bit parameter shard host-to-device;
both copies go through fixed-size staging buffers one chunk at a time (CB), so offloading never
allocates model-sized temporaries. On CUDA the host tensors are pinned for fast async copies. On a
CPU-only machine "device" and "host" are the same memory, but the path is the same: the state is
allocated on ``torch.device("cpu")`` and every transfer is an explicit copy into a staging buffer.
The clipping coefficient is computed on the accelerator; an offloaded state reads it once per
step (``coef_for``), the one host read ZeRO-Offload adds to a bf16 step.
"""

from __future__ import annotations

import bisect

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from zerotron.parallel import host_sync
from zerotron.zero.clip import apply_coef


class OptimizerState:
    """fp32 master, exp_avg and exp_avg_sq for this rank's partition, plus a gradient staging buffer."""

    def __init__(self, numel: int, max_shard: int, device: torch.device, offload: bool, own_master: bool = True,
                 dtype: torch.dtype = torch.float32):
        self.offload = offload
        # own_master=False (fp32 runs on the device): the fp32 parameters themselves are the master
        # weights, so no second copy exists (K = 8); ``attach`` binds the master to their storage.
        self.own_master = own_master
        self.device = torch.device("cpu") if offload else device
        pin = offload and host_sync.pinned(device)

        def alloc(n):  # pinned directly: ``zeros(n).pin_memory()`` made a pageable copy first
            return torch.zeros(n, dtype=dtype, device=self.device, pin_memory=pin)

        self.master = alloc(numel) if own_master else None
        self.exp_avg, self.exp_avg_sq = alloc(numel), alloc(numel)
        # fp32 gradient shard of one chunk (D2H target); fp32 on-device gradients need none
        self.grad_stage = alloc(max_shard if own_master else 0)
        self.step = 0
        self.layout, self.decay, self.masters = None, [], []

    def attach(self, layout, decay_segments: list, param_shards: list[torch.Tensor]) -> None:
        """``masters[c]``: chunk ``c``'s shard of the own master, or of the parameter storage itself."""
        self.layout, self.decay = layout, decay_segments
        if self.own_master:
            self.masters = [self.master[c.part_offset:c.part_offset + c.shard] for c in layout.chunks]
        else:
            self.masters, self.master = list(param_shards), _joined(param_shards)

    def part_slice(self, key: str, off: int, n: int) -> torch.Tensor:
        if key != "master" or self.master is not None:
            return getattr(self, key)[off:off + n]
        starts = [c.part_offset for c in self.layout.chunks]
        c = self.layout.chunks[bisect.bisect_right(starts, off) - 1]
        return self.masters[c.index][off - c.part_offset:off - c.part_offset + n]

    def commit(self) -> None:
        pass  # writes land in the tensors themselves

    def tensors(self) -> dict[str, torch.Tensor]:
        """The partition's state; a master scattered over the parameter storage is concatenated (a copy)."""
        master = self.master if self.master is not None else torch.cat(self.masters)
        return {"master": master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def update(self, grads, adamw, coef: torch.Tensor | float) -> None:
        """AdamW chunk by chunk, each reduced gradient shard staged to fp32 first (CB)."""
        coef = coef_for(coef, self.device)
        for c in self.layout.chunks:
            lo, hi = c.part_offset, c.part_offset + c.shard
            grad = self.stage_grad(grads.grad_shard(c), coef)
            adamw(self.masters[c.index], grad, self.exp_avg[lo:hi], self.exp_avg_sq[lo:hi], self.decay[c.index])

    def fresh(self, c) -> torch.Tensor | None:
        """An own master still has to be copied into the parameters; a shared one is them."""
        return self.masters[c.index] if self.own_master else None

    def stage_grad(self, grad_shard: torch.Tensor, coef: torch.Tensor | float) -> torch.Tensor:
        """Copy (D2H when offloading) and cast one reduced gradient shard to fp32, scaled by ``coef``
        (a tensor or a float in the state's memory: ``coef_for``).

        An fp32 shard already in the state's memory is scaled in place instead (no copy): the reduced
        gradient is consumed by this step and zeroed right after it."""
        if grad_shard.dtype == self.exp_avg.dtype and grad_shard.device == self.device:
            return apply_coef(grad_shard, coef)
        out = self.grad_stage[:grad_shard.numel()]
        out.copy_(grad_shard)  # blocking: the CPU Adam reads it next
        return apply_coef(out, coef)

    def resident(self) -> list[torch.Tensor]:
        return [t for t in (self.master if self.own_master else None, self.exp_avg, self.exp_avg_sq,
                            self.grad_stage) if t is not None]

    def memory_report(self) -> dict:
        size = self.exp_avg.element_size()
        master = self.master.numel() * size if self.own_master else 0
        return {"host" if self.offload else "device": {
            "master_fp32": master, "optimizer_moments": (self.exp_avg.numel() + self.exp_avg_sq.numel()) * size,
            "fixed_buffers": self.grad_stage.numel() * self.grad_stage.element_size(),
            "pinned_rounding": host_sync.pinned_rounding(self.resident())}}

    def io_report(self) -> dict:
        return {}


def coef_for(coef: torch.Tensor | float, device: torch.device) -> torch.Tensor | float:
    """The clipping coefficient where the update runs (``device``), moved once per step.

    ZeRO-Offload keeps the state on the host while the norm is computed on the accelerator, so a
    device coefficient is read once per step (``host_sync``, reason ``"offload_coef"``): a
    device-to-host copy waits for the step's kernels whatever form it takes, and the gradient
    shards' copies that follow would wait for them anyway. As a Python float it scales the fp32
    shards exactly as the tensor would (both round it to fp32 once)."""
    if not isinstance(coef, torch.Tensor) or coef.device == device:
        return coef
    if device.type == "cpu":
        return host_sync.read(coef, "offload_coef", placeholder=1.0)
    return coef.to(device, non_blocking=True)


def _joined(views: list[torch.Tensor]) -> torch.Tensor | None:
    """One tensor over ``views`` when they lie back to back in one storage (else None)."""
    first = views[0]
    storage = StorageWeakRef(first.untyped_storage())  # compares StorageImpls: fake tensors too
    end = first.storage_offset()
    for v in views:
        if StorageWeakRef(v.untyped_storage()) != storage or v.storage_offset() != end:
            return None
        end += v.numel()
    return first.as_strided((end - first.storage_offset(),), (1,))
