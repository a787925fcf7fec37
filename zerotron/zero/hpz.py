"""ZeRO++ wiring: which groups the quantized and hierarchical collectives use, and hpZ's secondary partition.

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

``setup`` validates the sizes against the DP group and creates the groups (``Grid.split_group``,
a collective every rank calls with the same config) before any other collective of the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerotron.parallel import collectives as C


@dataclass
class ZeroPP:
    block: int                      # quantization block (elements per fp32 scale)
    qwz: bool = False
    hpz_group: object = None        # secondary-partition group ("dp_inner"), None: hpZ off
    qgz: bool = False
    qgz_inner: object = None        # hierarchical qgZ groups; None: flat all-to-all over DP
    qgz_outer: object = None


def setup(cfg, grid) -> ZeroPP:
    """Validate the ZeRO++ sizes against the DP size and create the node-local groups."""
    dp = grid.dp_group
    cfg.validate(dp_size=dp.size)  # hpZ / qgZ sizes must divide DP: raised on every rank, no collective yet
    pp = ZeroPP(block=cfg.zero_quantization_block_size, qwz=cfg.zero_quantized_weights,
                qgz=cfg.zero_quantized_gradients)
    k = cfg.zero_hpz_partition_size
    if 1 < k < dp.size:
        pp.hpz_group, _ = grid.split_group("dp", k)
    node = cfg.qgz_node_size
    if cfg.zero_quantized_gradients and 1 < node < dp.size:
        pp.qgz_inner, pp.qgz_outer = grid.split_group("dp", node)
    return pp


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
