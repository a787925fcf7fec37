"""Where the fp32 optimizer state lives: on the accelerator, or on the host (ZeRO-Offload).

ZeRO-Offload moves the Pos state (fp32 master weights and both Adam moments, 12 of the 16 bytes
per parameter) and the Adam step itself to the CPU. Per step each rank copies its reduced
gradient shard device-to-host (as fp32) and its updated 16-bit parameter shard host-to-device;
both copies go through fixed-size staging buffers one chunk at a time (CB), so offloading never
allocates model-sized temporaries. On CUDA the host tensors are pinned for fast async copies. On a
CPU-only machine "device" and "host" are the same memory, but the path is the same: the state is
allocated on ``torch.device("cpu")`` and every transfer is an explicit copy into a staging buffer.
"""

from __future__ import annotations

import torch


class OptimizerState:
    """fp32 master, exp_avg and exp_avg_sq for this rank's partition, plus a gradient staging buffer."""

    def __init__(self, numel: int, max_shard: int, device: torch.device, offload: bool, own_master: bool = True,
                 dtype: torch.dtype = torch.float32):
        self.offload = offload
        # own_master=False (fp32 runs on the device): the fp32 parameters themselves are the master
        # weights, so no second copy exists (K = 8); the optimizer sets ``master`` to its storage.
        self.own_master = own_master
        self.device = torch.device("cpu") if offload else device
        pin = offload and device.type == "cuda"

        def alloc(n):
            t = torch.zeros(n, dtype=dtype, device=self.device)
            return t.pin_memory() if pin else t

        self.master = alloc(numel) if own_master else None
        self.exp_avg, self.exp_avg_sq = alloc(numel), alloc(numel)
        # fp32 gradient shard of one chunk (D2H target); fp32 on-device gradients need none
        self.grad_stage = alloc(max_shard if own_master else 0)
        self.step = 0

    def stage_grad(self, grad_shard: torch.Tensor, coef: float) -> torch.Tensor:
        """Copy (D2H when offloading) and cast one reduced gradient shard to fp32, scaled by ``coef``.

        An fp32 shard already in the state's memory is scaled in place instead (no copy): the reduced
        gradient is consumed by this step and zeroed right after it."""
        if grad_shard.dtype == self.exp_avg.dtype and grad_shard.device == self.device:
            if coef != 1.0:
                grad_shard.mul_(coef)
            return grad_shard
        out = self.grad_stage[:grad_shard.numel()]
        out.copy_(grad_shard)  # blocking: the CPU Adam reads it next
        if coef != 1.0:
            out.mul_(coef)
        return out

    def write_params(self, dst: torch.Tensor, lo: int, hi: int) -> None:
        """Copy updated master elements ``[lo, hi)`` into 16-bit ``dst`` (H2D when offloading)."""
        dst.copy_(self.master[lo:hi], non_blocking=False)

    def state_bytes(self) -> tuple[int, int]:
        """(master bytes, moment bytes)."""
        size = self.exp_avg.element_size()
        master = self.master.numel() * size if self.own_master else 0
        return master, (self.exp_avg.numel() + self.exp_avg_sq.numel()) * size

    def staging_bytes(self) -> int:
        return self.grad_stage.numel() * self.grad_stage.element_size()
