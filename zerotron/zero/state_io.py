"""Checkpoint support of the ZeRO optimizer: its partition described, saved, loaded, gathered.

A rank's partition is a set of element ranges of flattened (TP-local) parameters; describing it
as ``(name, start, end, offset)`` lets a checkpoint written by one layout be loaded by any other
(``zerotron.checkpoint.distributed``), and ``full_params`` streams whole parameters for export.
Mixed into ``ZeroOptimizer``; it relies on the optimizer's ``layout``, ``names``, ``grid``,
``device``, ``scaler``, ``_publish`` and ``state`` -- the ``OptimizerStateStore`` protocol of
``zero.strategies``, so a checkpoint reads and writes every kind of state (memory, host, disk) alike.
"""

from __future__ import annotations

import torch

from zerotron.parallel import collectives as C

STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


class PartitionStateIO:
    def partition_index(self) -> list[tuple[str, int, int, int]]:
        return self.layout.partition_index(self.names)

    def partition_state(self) -> dict:
        return {**self.state.tensors(), "step": self.state.step, "loss_scaler": self.scaler.state_dict()}

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
                    st.part_slice(key, off, end - start).copy_(value.reshape(-1))
        if step is not None:
            st.step = int(step)
        if loss_scaler is not None:
            self.scaler.load_state_dict(loss_scaler)
        self._publish()

    def full_params(self):
        """Yield ``(name, full fp32 TP-local tensor)`` from the master weights, gathered over DP."""
        lay, dp = self.layout, self.grid.dp_cp_group
        parts: dict[int, torch.Tensor] = {}
        done = [0] * len(lay.numels)
        for c in lay.chunks:
            mine = self.state.masters[c.index].to(self.device)
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
