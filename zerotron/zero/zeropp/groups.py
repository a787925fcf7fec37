"""ZeRO++ groups (which ranks the quantized and hierarchical collectives span) and hpZ's secondary partition.

ZeRO++ (Wang et al., arXiv 2306.10209) attacks the 3Ψ communication of Pos+g+p (ZeRO §7.2.2):

* **qwZ** -- the parameter all-gathers carry int8 block-quantized weights (``quantized_comm``);
  the master weights stay exact, only what crosses the wire is quantized.
* **hpZ** -- each rank keeps a *secondary* copy of the parameters, partitioned over a small group
  (the GPUs of one node, ``zero_hpz_partition_size``): its 1/k slice of every gathered chunk. The
  forward all-gather still spans the whole DP group (and fills the secondary slice for free, from
  what it received); the backward all-gather then runs inside the node only (group ``dp_inner``),
  trading Ψ/k extra parameter memory per rank for no cross-node traffic in backward. The
  secondary copy is derived from the parameters, so it is invalidated after every optimizer step
  and rebuilt by the next forward gather.
* **qgZ** -- the gradient reduce-scatter becomes a quantized all-to-all, hierarchical (inside the
  node first, then across nodes) so the cross-node step moves 1/node_size of the data.

``node_groups`` creates the node-local groups (``Grid.split_group``, a collective every rank calls
with the same sizes); ``zero.strategy_choice.build`` calls it after validating the sizes against the DP
group and hands the groups to the strategies of ``zeropp.strategies``.
"""

from __future__ import annotations

import torch

from zerotron.parallel import collectives as C
from zerotron.parallel.grid import layout, split_blocks


def node_crossing(dims, size: int, gpus_per_node: int) -> tuple[int, ...] | None:
    """The first inner group of ``size`` consecutive DP members whose ranks lie on more than one
    node (ranks fill nodes in order: node = rank // gpus_per_node), or None when every one is local.

    Pure arithmetic over the grid's layout, the same blocks ``Grid.split_group`` makes. DP members
    are ``tp`` ranks apart, so a block of k spans k·tp ranks: on 8-GPU nodes with tp 2, k = 8 spans
    two nodes."""
    if not 1 < size < dims.dp:
        return None
    for ranks in layout(dims)["dp"]:
        for block in split_blocks(ranks, size):
            if len({r // gpus_per_node for r in block}) > 1:
                return block
    return None


def check_node_local(zero, dims, gpus_per_node: int | None) -> None:
    """Refuse hpZ / qgZ sizes whose "node-local" groups would cross nodes (``ValueError`` naming the
    key, the value and the fix); ``gpus_per_node`` None (unknown): nothing to check."""
    if not gpus_per_node:
        return
    for key, size in (("zero_hpz_partition_size", zero.zero_hpz_partition_size),
                      ("zero_quantized_gradients_node_size", zero.qgz_node_size)):
        if key == "zero_quantized_gradients_node_size" and not zero.zero_quantized_gradients:
            continue
        block = node_crossing(dims, size, gpus_per_node)
        if block is not None:
            nodes = sorted({r // gpus_per_node for r in block})
            fit = max(1, gpus_per_node // dims.tp)
            raise ValueError(
                f"zero.{key}={size}: its node-local group of DP ranks {list(block)} spans nodes "
                f"{nodes} of {gpus_per_node} GPUs with parallel.tp={dims.tp}; a node holds {fit} "
                f"members of each DP group: use {fit} or a divisor of it")


def node_groups(grid, size: int) -> tuple:
    """``(inner, outer)`` DP groups of ``size`` consecutive members (``(None, None)``: no split needed)."""
    if 1 < size < grid.dp_group.size:
        return grid.split_group("dp", size)
    return None, None


class SecondaryPartition:
    """hpZ: this rank's 1/k slice (k = inner group size) of every non-persistent stage-3 chunk.

    Chunk ``c`` (``c.numel`` elements, a multiple of the DP size, hence of k) is split into k
    slices; the member at position ``l`` of the inner group keeps slice ``l``, so an all-gather over
    the inner group rebuilds the chunk exactly as the forward gather delivered it (dequantized
    values under qwZ, so forward and backward see the same weights)."""

    def __init__(self, layout, group, global_rank: int, dtype: torch.dtype, device: torch.device):
        self.layout, self.group = layout, group
        self.k, self.pos = group.size, group.rank_of(global_rank)
        self.offset: dict[int, int] = {}
        total = 0
        for g in layout.groups:
            if g.persistent:
                continue
            for ci in g.chunks:
                self.offset[ci] = total
                total += layout.chunks[ci].numel // self.k
        self.buf = torch.zeros(total, dtype=dtype, device=device)
        self.valid = [False] * len(layout.groups)

    def _slices(self, g: int, full: torch.Tensor):
        group = self.layout.groups[g]
        for ci in group.chunks:
            c = self.layout.chunks[ci]
            n = c.numel // self.k
            local = c.offset - group.offset
            yield full[local:local + c.numel], self.buf[self.offset[ci]:self.offset[ci] + n], n

    def fill(self, g: int, full: torch.Tensor) -> None:
        """Keep this rank's slice of group ``g`` from a just-completed full-DP gather."""
        for chunk, mine, n in self._slices(g, full):
            mine.copy_(chunk[self.pos * n:(self.pos + 1) * n])
        self.valid[g] = True

    def gather(self, g: int, full: torch.Tensor, async_op: bool) -> list:
        """Rebuild group ``g`` into ``full`` from the secondary slices: all-gather inside the node only."""
        return [C.all_gather(chunk, mine, self.group, async_op=async_op) for chunk, mine, _ in self._slices(g, full)]

    def invalidate(self) -> None:
        self.valid = [False] * len(self.valid)

    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()
