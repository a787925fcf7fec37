"""Checkpoint support of the ZeRO optimizer: its partition described, saved, loaded, gathered.

A rank's partition is a set of element ranges of flattened (TP-local) parameters; describing it
as ``(name, start, end, offset)`` lets a checkpoint written by one layout be loaded by any other
(``zerotron.training.checkpoint``), and ``full_params`` streams whole parameters for export.
Mixed into ``ZeroOptimizer``; it relies on the optimizer's ``layout``, ``state``, ``masters``,
``names``, ``params``, ``grid``, ``device``, ``scaler`` and ``_publish``.
"""

from __future__ import annotations

import bisect

import torch

from zerotron.parallel import collectives as C

STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


class PartitionStateIO:
    @property
    def param_shapes(self) -> dict[str, torch.Size]:
        """TP-local shape of every parameter by name (stage 3 releases ``p.data``, so ``p.shape`` lies)."""
        return dict(zip(self.names, self.layout.shapes))

    def partition_index(self) -> list[tuple[str, int, int, int]]:
        return self.layout.partition_index(self.names)

    def partition_state(self) -> dict:
        st = self.state
        master = st.master if st.master is not None else torch.cat(self.masters)  # a copy only when scattered
        return {"master": master, "exp_avg": st.exp_avg, "exp_avg_sq": st.exp_avg_sq, "step": st.step,
                "loss_scaler": self.scaler.state_dict()}

    def load_partition_state(self, read_fn, step: int | None = None, loss_scaler: dict | None = None) -> None:
        """Fill this rank's partition with ``read_fn(param_name, key, start, end)`` for every indexed range."""
        st = self.state
        with torch.no_grad():
            for name, start, end, off in self.partition_index():
                for key in STATE_KEYS:
                    value = read_fn(name, key, start, end)
                    if value.numel() != end - start:
                        raise ValueError(f"load_partition_state: {name}[{start}:{end}] {key} has {value.numel()} "
                                         f"elements, expected {end - start}")
                    self._part_slice(key, off, end - start).copy_(value.reshape(-1))
        if step is not None:
            st.step = int(step)
        if loss_scaler is not None:
            self.scaler.load_state_dict(loss_scaler)
        self._publish()

    def _part_slice(self, key: str, off: int, n: int) -> torch.Tensor:
        """Elements ``[off, off + n)`` of this rank's partition of state ``key`` (never across chunks)."""
        if key != "master" or self.state.master is not None:
            return getattr(self.state, key)[off:off + n]
        starts = [c.part_offset for c in self.layout.chunks]
        c = self.layout.chunks[bisect.bisect_right(starts, off) - 1]
        return self.masters[c.index][off - c.part_offset:off - c.part_offset + n]

    def full_params(self):
        """Yield ``(name, full fp32 TP-local tensor)`` from the master weights, gathered over DP."""
        lay, dp = self.layout, self.grid.dp_group
        parts: dict[int, torch.Tensor] = {}
        done = [0] * len(self.params)
        for c in lay.chunks:
            mine = self.masters[c.index].to(self.device)
            if lay.shards == 1:
                full = mine
            else:
                full = torch.empty(c.numel, dtype=mine.dtype, device=self.device)
                C.all_gather(full, mine, dp)
            for pc in c.pieces:
                buf = parts.setdefault(pc.param, torch.empty(lay.numels[pc.param], dtype=mine.dtype, device=self.device))
                buf[pc.start:pc.end].copy_(full[pc.offset:pc.offset + pc.end - pc.start])
                done[pc.param] += 1
                if done[pc.param] == len(lay.param_chunks[pc.param]):
                    yield self.names[pc.param], parts.pop(pc.param).view(lay.shapes[pc.param])
