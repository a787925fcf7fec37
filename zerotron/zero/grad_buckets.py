"""The packed reduce buckets (CB, ZeRO §6.2) and which chunk of the layout fills each.

A chunk claims a bucket when its first gradient arrives and holds it until it is reduced. Two
rules keep a bucket from being held by a chunk that cannot fill it soon:

* a claim that cannot be completed -- a gradient spanning two chunks when only one bucket is
  free -- is given back at once (``release``) rather than kept by the first chunk;
* the persistent group's chunks (stage 3's small parameters: LayerNorms and biases of every
  block, ``plan.plan_groups``) receive gradients from the first block's backward to the last,
  so they fill only at the end of backward. They get buffers of their own, sized to them, and
  never hold a shared bucket; otherwise every other chunk would reduce through a temporary one.
"""

from __future__ import annotations

import torch


class BucketPool:
    """``n_buf`` shared buckets of the largest non-persistent chunk; one per persistent chunk."""

    def __init__(self, layout, n_buf: int, dtype: torch.dtype, device: torch.device):
        self.layout, self.n_buf = layout, n_buf
        own = [ci for g in layout.groups if g.persistent for ci in g.chunks]
        shared = max((c.numel for c in layout.chunks if c.index not in own), default=0)
        self.shared = [torch.empty(shared, dtype=dtype, device=device) for _ in range(n_buf)]
        own_numel = sum(layout.chunks[ci].numel for ci in own)
        self.own_buffer = torch.empty(own_numel, dtype=dtype, device=device)
        self.own: dict[int, torch.Tensor] = {}  # persistent chunk -> its view of own_buffer
        offset = 0
        for ci in own:
            self.own[ci] = self.own_buffer.narrow(0, offset, layout.chunks[ci].numel)
            offset += layout.chunks[ci].numel
        self.slot_of: dict[int, int | tuple] = {}  # chunk still filling -> the bucket it fills

    def tensors(self) -> list[torch.Tensor]:
        return [*self.shared, self.own_buffer]

    def bucket(self, slot) -> torch.Tensor:
        """Slot ``int``: a shared bucket; ``("own", ci)``: persistent chunk ``ci``'s buffer."""
        return self.shared[slot] if isinstance(slot, int) else self.own[slot[1]]

    def claim(self, ci: int, busy, wait_for) -> int | tuple | None:
        """A zeroed bucket for chunk ``ci``: its own, or a shared one no open chunk holds
        (``wait_for`` the reductions still reading it, ``busy(slot)`` telling which); None when
        all are held."""
        if ci in self.own:
            slot = ("own", ci)
        else:
            held = set(self.slot_of.values())
            free = [s for s in range(self.n_buf) if s not in held]
            if not free:
                return None
            idle = [s for s in free if not busy(s)]
            slot = (idle or free)[0]  # a bucket no reduction reads keeps two of them in flight
        wait_for(slot)
        self.bucket(slot)[:self.layout.chunks[ci].numel].zero_()
        self.slot_of[ci] = slot
        return slot

    def release(self, ci: int):
        """Chunk ``ci`` no longer fills its bucket (reduced, or its claim given back): its slot."""
        return self.slot_of.pop(ci, None)

    def reset(self) -> None:
        self.slot_of = {}  # a backward that raised part-way must not leave a half-filled bucket
