"""ZeRO-Infinity: the stage-3 parameter partition on local disk, read just before its unit's all-gather.

ZeRO-Infinity (Rajbhandari et al., arXiv 2104.07857, §5-6) puts the parameters of Pos+g+p in the
NVMe tier too. Between gathers a rank needs its shard of a unit only as the *input* of that unit's
all-gather, so the shard can live in a file, be read right before the gather -- read ahead for
the next unit while the current one computes (the paper's overlap-centric design) -- and be
dropped once the gathered parameters exist. That takes the last Ψ/Nd·(param bytes) of model state
but the gradient partition out of memory; what stays is the gradient partition, the units being
gathered and at most ``buffer_count`` read / write buffers.

Layout: one fp32 file per rank holding its partition in partition order. The chunks of a layout
group (one gather unit) are consecutive in the partition, so a unit is one contiguous ``pread``.
In 16-bit runs the file holds the 16-bit-rounded values (as fp32, which is exact), so gathered
parameters are bit-identical to the in-memory ones.

Consistency with the master weights (one source of truth): the optimizer's fp32 master is
authoritative -- in its own NVMe file (``disk_optimizer_state``) or in memory -- and this file is a
derived copy, rewritten from the updated master after every step (write-behind, from inside the
optimizer's tile loop when the optimizer is on NVMe too) and never read by the optimizer or by
checkpoints (``partition_state``/``full_params`` read the master). We keep two files rather than
sharing one because the optimizer file is tile-major (master, exp_avg, exp_avg_sq interleaved per
``sub_group_size`` tile) for the step's streaming while a gather wants its unit's shard
contiguous; sharing would turn every unit read into strided reads across tiles. The price is
4Ψ/Nd bytes of disk and one extra write per element per step -- which DeepSpeed pays as well (its
16-bit parameters on NVMe are separate from the fp32 master). Ordering: every read of the file
first waits for the pending write-behinds, so a gather never sees a half-written step.
"""

from __future__ import annotations

import shutil
import weakref
from concurrent.futures import Future

import torch

from zerotron.zero.infinity.disk_store import DiskTensorStore, rank_directory


def expected_param_offload_bytes(psi: int, dp: int, param_bytes: int = 4) -> dict:
    """What ``offload_param`` moves per rank: the Ψ/Nd-element partition out of memory, onto disk (fp32 file)."""
    return {"memory_saved": param_bytes * psi / dp, "disk": 4 * psi / dp}


class DiskParams:
    """``ShardSource`` (``zero.strategies``): this rank's stage-3 partition in a file, read per unit
    ahead of its gather and rewritten behind the step."""

    def __init__(self, layout, directory: str, rank: int, buffer_count: int, owner=None):
        self.dir = rank_directory(directory, f"zerotron_params_rank{rank}_")
        self.store = DiskTensorStore(self.dir, buffer_count=buffer_count)
        self.ranges = []  # per layout group: its [lo, hi) in the partition (its chunks are consecutive)
        for g in layout.groups:
            first, last = layout.chunks[g.chunks[0]], layout.chunks[g.chunks[-1]]
            self.ranges.append((first.part_offset, last.part_offset + last.shard))
        self.max_group = max(hi - lo for lo, hi in self.ranges)
        self.numel = layout.part_numel
        self.pending: dict[int, Future] = {}  # group -> read ahead, holding one buffer slot each
        self.taken: dict[int, torch.Tensor] = {}  # group -> shard an async gather still reads
        self.writes: list[Future] = []
        self.read_ahead_hits = 0  # gathers whose shard was already read ahead (the overlap working)
        # The file goes with ``owner`` (the optimizer): this object is also held by the gatherer, whose
        # hooks and the model reference each other -- a cycle freed only by the garbage collector.
        self._finalizer = weakref.finalize(owner if owner is not None else self, _cleanup, self.store, self.dir)

    def adopt(self, part: torch.Tensor) -> torch.Tensor:
        """Write the initial partition to the file; what stays in memory is an empty tensor."""
        self.store.create("param", part)
        self.dtype, self.device = part.dtype, part.device
        return torch.empty(0, dtype=part.dtype, device=part.device)

    # reads: just before the all-gather ------------------------------------------------------------
    def take(self, g: int) -> tuple[torch.Tensor, int]:
        """Group ``g``'s shard (partition elements ``[lo, hi)``) and ``lo``; read ahead or read now."""
        lo, hi = self.ranges[g]
        fut = self.pending.pop(g, None)
        if fut is not None:
            data = fut.result()
            self.read_ahead_hits += 1
            self.store.release()  # the buffer now belongs to the gather, which drops it when done
        else:
            self._sync_writes()
            data = self.store.read_range("param", lo, hi)
        self.taken[g] = data.to(device=self.device, dtype=self.dtype)
        return self.taken[g], lo

    def done(self, g: int) -> None:
        """The gather of group ``g`` no longer reads its shard."""
        self.taken.pop(g, None)

    def read_ahead(self, groups) -> None:
        """Start reading these groups' shards; one slot is always left for a write-behind."""
        for g in groups:
            if g in self.pending:
                continue
            if len(self.pending) >= self.store.buffer_count - 1:
                return
            self._sync_writes()
            lo, hi = self.ranges[g]
            self.pending[g] = self.store.read_ahead("param", lo, hi)

    def settle(self) -> None:
        """Forget read-aheads nobody will take (end of backward, before a step rewrites the file)."""
        for fut in self.pending.values():
            fut.result()
            self.store.release()
        self.pending.clear()

    # writes: after the step -----------------------------------------------------------------------
    def write(self, lo: int, values: torch.Tensor) -> None:
        """Partition elements ``[lo, lo + n)`` := ``values`` (master, rounded to the param dtype), behind."""
        self.settle()
        t = values.detach().to(device="cpu", dtype=self.dtype, copy=True)  # host-side file; a snapshot
        self.writes.append(self.store.write_behind("param", lo, t, take_slot=True))

    def _sync_writes(self) -> None:
        for w in self.writes:
            w.result()
        self.writes.clear()

    # accounting -----------------------------------------------------------------------------------
    def memory_report(self) -> dict:
        return {"disk": {"params": 4 * self.numel},
                "host": {"fixed_buffers": self.store.buffer_count * 4 * self.max_group}}

    def io_report(self) -> dict:
        return {"read": self.store.bytes_read, "written": self.store.bytes_written,
                "read_ahead_hits": self.read_ahead_hits}


def _cleanup(store, directory) -> None:
    try:
        store.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
