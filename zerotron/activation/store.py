"""Where activation checkpoints live between forward and recompute: Pa, Pa+cpu, MD, CB (ZeRO §6).

``CheckpointStore.save`` is called once per checkpoint in forward and ``load`` once before its
recompute in backward:

* **Pa** (§6.1, partitioned activations): the checkpoint is replicated on every TP rank (it is
  the residual stream after Megatron's g), so each rank keeps only its 1/tp slice of the
  flattened tensor; ``load`` all-gathers the slices over the "tp" group (counted by
  ``collectives``) -- one b·s·h all-gather per checkpoint, 1/12 of a block's TP all-reduce
  volume with recompute (§8).
* **Pa+cpu** / CPU offload (§6.1, §4.2.1): the kept piece (the whole checkpoint without Pa)
  goes to host memory after forward and comes back before recompute. On CUDA the host memory is
  pinned and the copies run on a side stream; while chunk i is recomputed the copy of chunk i-1
  is already in flight, which the paper's arithmetic-intensity argument says hides it. The
  pinned pieces are allocated pinned (never pinned from a pageable copy) and counted at the
  caching host allocator's power-of-two blocks (``host_sync.pinned_rounding``), the host RAM
  they really hold: a piece of 1.1 GiB holds 2 GiB.
* **MD** (§6.3): checkpoints are copied into slots of one buffer allocated once
  (``number_checkpoints`` slots of b·s·h/tp elements), so these long-lived tensors do not
  interleave with short-lived ones and fragment memory.
* **CB** (§6.2): the Pa gather buffer holds one checkpoint (b·s·h), whatever the number of layers.

``ActivationAccounting`` counts bytes of live checkpoints by placement ("device" vs "host" --
kept apart on CPU-only runs too, where "host" means the offloaded copy), their peaks, and the
Pa all-gather volume.
"""

from __future__ import annotations

import weakref

import torch

from zerotron.parallel import host_sync
from zerotron.parallel import collectives as C


class ActivationAccounting:
    """Live/peak bytes of saved checkpoints per placement, and the extra all-gather volume of Pa."""

    def __init__(self) -> None:
        self.live = {"device": 0, "host": 0}
        self.peak = {"device": 0, "host": 0}
        self.checkpoints = self.peak_checkpoints = 0
        self.gathered_elements = self.gathered_bytes = 0
        self.pinned_rounding = 0  # of the live host pieces: host RAM beyond their size

    def add(self, placement: str, nbytes: int, count: int = 1, rounding: int = 0) -> None:
        self.pinned_rounding += rounding
        self.live[placement] += nbytes
        self.peak[placement] = max(self.peak[placement], self.live[placement])
        self.checkpoints += count
        self.peak_checkpoints = max(self.peak_checkpoints, self.checkpoints)

    def sub(self, placement: str, nbytes: int, count: int = 1, rounding: int = 0) -> None:
        self.pinned_rounding -= rounding
        self.live[placement] -= nbytes
        self.checkpoints -= count

    def reset_peak(self) -> None:
        """Start a new step: peaks restart from what is live now, the gather counters from 0."""
        self.peak = dict(self.live)
        self.peak_checkpoints = self.checkpoints
        self.gathered_elements = self.gathered_bytes = 0


class ContiguousBuffer:
    """MD (§6.3): ``slots`` equal slots in one flat tensor, handed out and given back by index."""

    def __init__(self, slots: int, slot_numel: int, dtype, device, pin: bool):
        self.slot_numel = slot_numel
        self.flat = torch.empty(slots * slot_numel, dtype=dtype, device=device, pin_memory=pin)
        self.free = list(range(slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def take(self, numel: int) -> tuple[int, torch.Tensor]:
        if not self.free:
            slots = self.flat.numel() // self.slot_numel
            raise RuntimeError(
                f"activation_checkpointing.number_checkpoints={slots}: all slots of the contiguous checkpoint "
                f"buffer (MD) are in use; raise it to the checkpoints alive at once (chunks per micro-batch x "
                f"micro-batches in flight, e.g. x pipeline stages for 1F1B) or leave it unset")
        slot = self.free.pop()
        return slot, self.flat[slot * self.slot_numel: slot * self.slot_numel + numel]

    def give_back(self, slot: int) -> None:
        self.free.append(slot)


class Saved:
    """One checkpoint as stored; gives its memory back when released or garbage-collected."""

    def __init__(self, store, data, slot, shape, numel, device, placement):
        self.store, self.data, self.slot = store, data, slot
        self.shape, self.numel, self.device, self.placement = shape, numel, device, placement
        # a pinned host piece holds its allocator block, rounded up to a power of two; an MD slot
        # is a view of one buffer whose rounding ``CheckpointStore.report`` counts once
        rounding = host_sync.pinned_rounding([data]) if placement == "host" and slot is None else 0
        self.nbytes = data.numel() * data.element_size() + rounding
        self.pinned_rounding = rounding
        self.ready = None          # CUDA event: the copy into ``data`` is done
        self.on_device = None      # prefetched device copy of a host piece
        self.released = False

    def __del__(self):  # forward ran with grad but backward never did (eval, dropped loss)
        if not self.released:
            try:
                self.store.release(self)
            except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to give back to
                pass


class CheckpointStore:
    """Saves checkpoint inputs (partitioned / offloaded / contiguous as configured) and restores them."""

    def __init__(self, grid, cfg, slots: int, replicated: bool = True):
        """``replicated``: the checkpoints are the same on every TP rank (False with sequence
        parallelism, where each is already this rank's piece and Pa has nothing to partition)."""
        self.group = grid.tp_group
        self.tp_size, self.tp_rank = grid.tp_size, grid.tp_rank
        self.partition = cfg.partition_activations and grid.tp_size > 1 and replicated
        self.offload = cfg.cpu_checkpointing
        self.contiguous = cfg.contiguous_memory_optimization
        self.slots = slots
        self.buffer: ContiguousBuffer | None = None   # MD
        self.gather_buf: torch.Tensor | None = None   # CB: Pa all-gather target, one checkpoint
        self.acct = ActivationAccounting()
        self._side = None                             # CUDA stream for host copies
        self._live: list[weakref.ref] = []            # forward order, for prefetching in backward

    # save (forward) ------------------------------------------------------------------------------
    def _piece_numel(self, numel: int) -> int:
        return -(-numel // self.tp_size) if self.partition else numel

    def _target(self, n: int, dtype, device: torch.device):
        """Fresh storage for a piece of ``n`` elements: an MD slot or a new tensor, on device or host."""
        place = torch.device("cpu") if self.offload else device
        pin = self.offload and host_sync.pinned(device)
        if not self.contiguous:
            return None, torch.empty(n, dtype=dtype, device=place, pin_memory=pin)
        b = self.buffer
        if b is None or b.flat.dtype != dtype or b.flat.device != place or n > b.slot_numel:
            if b is not None and len(b.free) < self.slots:
                raise RuntimeError(f"contiguous checkpoint buffer (MD): a checkpoint of {n} elements "
                                   f"{dtype} does not fit the {b.slot_numel}-element slots while checkpoints "
                                   f"are alive; keep micro-batch shapes fixed within a step")
            self.buffer = b = ContiguousBuffer(self.slots, n, dtype, place, pin)
        return b.take(n)

    def save(self, x: torch.Tensor) -> Saved:
        flat = x.detach().reshape(-1)
        numel, n = flat.numel(), self._piece_numel(flat.numel())
        lo = self.tp_rank * n if self.partition else 0
        piece = flat[lo:min(lo + n, numel)]
        slot = None
        if not (self.partition or self.offload or self.contiguous):
            data = flat  # plain checkpointing: keep the input tensor itself
        else:
            slot, data = self._target(n, flat.dtype, x.device)
            if piece.numel() < n:  # the last TP rank's slice is padded to equal size for all-gather
                data[piece.numel():].zero_()
            side = self._stream(x.device) if self.offload else None
            if side is not None:  # async device-to-host on the side stream, overlapping compute
                side.wait_stream(torch.cuda.current_stream(x.device))
                with torch.cuda.stream(side):
                    data[:piece.numel()].copy_(piece, non_blocking=True)
                flat.record_stream(side)  # x's memory is not reused before the copy has read it
            else:
                data[:piece.numel()].copy_(piece)
        saved = Saved(self, data, slot, x.shape, numel, x.device, "host" if self.offload else "device")
        if self.offload and self._side is not None:
            saved.ready = torch.cuda.Event()
            saved.ready.record(self._side)
        self.acct.add(saved.placement, saved.nbytes, rounding=saved.pinned_rounding)
        self._live = [r for r in self._live if r() is not None] + [weakref.ref(saved)]
        return saved

    # load (backward) -----------------------------------------------------------------------------
    def _stream(self, device):
        """The side stream of host copies; None without one (not CUDA, or a dry run): copy in order."""
        if self._side is None:
            self._side = host_sync.stream(device)
        return self._side

    def _fetch(self, saved: Saved) -> None:
        """Start the host-to-device copy of an offloaded CUDA checkpoint on the side stream."""
        if saved.on_device is not None or saved.released:
            return
        with torch.cuda.stream(self._stream(saved.device)):  # after its own device-to-host copy
            saved.on_device = saved.data.to(saved.device, non_blocking=True)
            saved.ready = torch.cuda.Event()
            saved.ready.record()
        self.acct.add("device", saved.nbytes - saved.pinned_rounding, count=0)

    def _piece_on_device(self, saved: Saved) -> torch.Tensor:
        if not self.offload or saved.device.type == "cpu":
            return saved.data  # on CPU runs the host copy is used in place
        if self._stream(saved.device) is None:  # an accelerator without a side stream: copy in order
            return saved.data.to(saved.device)
        self._fetch(saved)
        current = torch.cuda.current_stream(saved.device)
        current.wait_event(saved.ready)
        saved.on_device.record_stream(current)
        previous = self._previous(saved)
        if previous is not None:  # recomputed next: overlap its copy with this chunk's recompute
            self._fetch(previous)
        return saved.on_device

    def _previous(self, saved: Saved) -> Saved | None:
        live = [s for s in (r() for r in self._live) if s is not None and not s.released]
        i = next((j for j, s in enumerate(live) if s is saved), 0)
        return live[i - 1] if i > 0 else None

    def load(self, saved: Saved) -> torch.Tensor:
        """The whole checkpoint, on its device, shaped as saved (Pa: all-gathered over "tp")."""
        if saved.released:
            raise RuntimeError("activation checkpoint used after release: backward ran twice through a "
                               "checkpointed chunk (retain_graph is not supported with checkpointing)")
        piece = self._piece_on_device(saved)
        if not self.partition:
            return piece[:saved.numel].view(saved.shape)
        padded = piece.numel() * self.tp_size
        buf = self.gather_buf
        if buf is None or buf.numel() < padded or buf.dtype != piece.dtype or buf.device != piece.device:
            self.gather_buf = buf = torch.empty(padded, dtype=piece.dtype, device=piece.device)
        C.all_gather(buf[:padded], piece, self.group)
        self.acct.gathered_elements += padded
        self.acct.gathered_bytes += padded * piece.element_size()
        return buf[:saved.numel].view(saved.shape)

    def release(self, saved: Saved) -> None:
        """Give the checkpoint's memory back (its MD slot, host copy, prefetched device copy)."""
        if saved.released:
            return
        saved.released = True
        self.acct.sub(saved.placement, saved.nbytes, rounding=saved.pinned_rounding)
        if saved.on_device is not None:
            self.acct.sub("device", saved.nbytes - saved.pinned_rounding, count=0)
        if saved.slot is not None:  # the buffer is only ever replaced while every slot is free
            self.buffer.give_back(saved.slot)
        saved.data = saved.on_device = None

    # accounting ----------------------------------------------------------------------------------
    def report(self) -> dict:
        a = self.acct
        md = self.buffer.nbytes if self.buffer is not None else 0
        md_rounding = host_sync.pinned_rounding([self.buffer.flat]) if self.buffer is not None else 0
        md_place = ("host" if self.offload else "device") if self.buffer is not None else None
        slot_bytes = self.buffer.slot_numel * self.buffer.flat.element_size() if self.buffer is not None else 0
        gather = self.gather_buf.numel() * self.gather_buf.element_size() if self.gather_buf is not None else 0
        return {
            "checkpoints_live": a.checkpoints,
            "peak_checkpoints": a.peak_checkpoints,
            "saved_device_bytes": a.live["device"],
            "saved_host_bytes": a.live["host"],
            "peak_saved_device_bytes": a.peak["device"],
            "peak_saved_host_bytes": a.peak["host"],
            "pa_allgather_elements": a.gathered_elements,
            "pa_allgather_bytes": a.gathered_bytes,
            "md_buffer_bytes": md + md_rounding,  # a pinned MD buffer at its allocator block
            # host RAM the pinned pieces and MD buffer hold beyond their size (in the figures above)
            "pinned_rounding": a.pinned_rounding + md_rounding,
            "md_buffer_placement": md_place,
            "fixed_buffers": {"pa_gather_bytes": gather, "md_slot_bytes": slot_bytes},
        }
