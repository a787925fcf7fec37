"""Asynchronous checkpoint save: the loop stalls only while this rank's shard is copied to host
memory; a writer thread serialises, hashes and fsyncs it while training goes on.

As Megatron's ``--async-save`` and torchtitan's DCP ``async_save``. The collective parts of a save
stay on the main thread (``checkpointer.py``), where every rank issues them in the same order:
opening the ``.tmp`` directory (``write.open_checkpoint``) at the save step, and the commit
(``write.commit_checkpoint``: every rank's write agreed, metadata.json, the atomic rename,
pruning) once every writer is done -- noticed at a step boundary, or waited for before the next
save, at the last one, on SIGTERM and on ``TrainingStopped``. The writer thread issues no
collective: gloo and NCCL need every rank's collectives in one order, which a thread racing the
loop cannot keep. Until the commit the checkpoint is a ``step_XXXXXXXX.tmp`` directory, which no
load takes, so a rank killed mid-write leaves the previous checkpoint the newest complete one.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zerotron.parallel import faults, host_sync
from zerotron.checkpoint.write import write_own_shard

ALIGN = 64  # bytes: each tensor's view into the staging buffer starts at a multiple of this


class HostStaging:
    """One host buffer, pinned when it feeds a CUDA device, that holds a copy of this rank's shard.

    Allocated at the first save and reused by every later one (grown only if the shard grows):
    a fresh pinned allocation per save would cost about as much as the copy it serves.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.buffer: torch.Tensor | None = None

    def copy(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Host copies of ``tensors`` (views into the buffer), queued behind the device's work."""
        places, total = [], 0
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            places.append((name, total, nbytes, t))
            total += -(-nbytes // ALIGN) * ALIGN
        pin = host_sync.pinned(self.device)
        if self.buffer is None or self.buffer.numel() < total:
            self.buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
        out = {}
        for name, start, nbytes, t in places:
            view = self.buffer[start:start + nbytes].view(t.dtype).view(t.shape)
            view.copy_(t.detach(), non_blocking=pin)  # pinned: a DMA the writer waits for
            out[name] = view
        return out


@dataclass
class PendingSave:
    """A save whose shard the writer thread holds; committed once ``BackgroundWriter.wait`` hands
    it back."""

    step: int
    tmp: Path
    header: dict
    started: float  # time.perf_counter() when the save step began
    blocking_s: float  # the loop's stall so far: open + copy to host
    error: OSError | None = None  # the write's OSError, agreed across ranks at the commit
    crashed: BaseException | None = None  # anything else, re-raised on the main thread
    done: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None


class BackgroundWriter:
    """At most one save in flight per rank; every rank calls ``start`` and ``wait`` alike."""

    def __init__(self, grid, device: torch.device):
        self.grid, self.device = grid, device
        self.staging = HostStaging(device)
        self.pending: PendingSave | None = None

    def writing(self) -> bool | None:
        """None: no save in flight; else whether this rank's writer is still at work."""
        return None if self.pending is None else not self.pending.done.is_set()

    def start(self, tmp: Path, step: int, tensors: dict[str, torch.Tensor], meta: dict,
              header: dict, started: float) -> None:
        """Not collective: copy this rank's shard (``tensors``, placed by ``meta``) to host memory
        and hand it to a writer thread; ``started``: when the save step began."""
        if self.pending is not None:
            raise RuntimeError("a save is in flight; wait() for it first")  # the callers' contract
        host = self.staging.copy(tensors)
        ready = host_sync.event() if host_sync.pinned(self.device) else None
        if ready is not None:
            ready.record()  # the copies above are queued on the device; the writer waits for them
        pending = PendingSave(step, tmp, header, started, time.perf_counter() - started)
        pending.thread = threading.Thread(target=self._write, args=(pending, host, meta, ready),
                                          name=f"checkpoint-writer-{step}", daemon=False)
        self.pending = pending
        pending.thread.start()

    def _write(self, pending: PendingSave, host: dict, meta: dict, ready) -> None:
        """The writer thread: serialise, hash and fsync this rank's shard; no collective here."""
        try:
            if ready is not None:
                ready.synchronize()
            faults.hit("hold_writer", pending.step, self.grid.rank)  # test hook: a write in flight
            pending.error = write_own_shard(pending.tmp, pending.step, self.grid, host, meta)
            faults.hit("kill_in_writer", pending.step, self.grid.rank)  # test hook: uncommitted
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread by wait()
            pending.crashed = e
        finally:
            pending.done.set()

    def wait(self) -> PendingSave | None:
        """Not collective: wait for this rank's writer and hand its save over for the commit
        (None: nothing in flight); a crash of the writer is raised here, on the main thread."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        pending.thread.join()
        if pending.crashed is not None:  # a bug, not an OSError: as in a synchronous save, this
            raise pending.crashed  # rank raises and the others name it at their next collective
        return pending

    def abandon(self) -> int | None:
        """Not collective (the run is failing): let the writer finish its file and leave the
        checkpoint uncommitted. Returns its step, None when nothing was in flight."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        pending.thread.join()
        return pending.step
