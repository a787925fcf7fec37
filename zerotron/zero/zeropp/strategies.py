"""ZeRO++ (arXiv 2306.10209) as strategies at the seams of ``zero.strategies``.

* ``QuantizedGather`` -- qwZ (§3.1): the stage-3 all-gather moves int8 block-quantized shards
  (``quantized_all_gather``), asynchronous like the plain gather, so the prefetch overlaps it.
* ``SecondaryGather`` -- hpZ (§3.2): wraps the forward gather (plain or qwZ); what it delivers
  fills this rank's slice of the secondary partition, and a backward gather of a group whose
  slice is valid runs inside the node only (``SecondaryPartition.gather``). A step invalidates the
  slices; persistent groups are not held twice.
* ``QuantizedReduceScatter`` -- qgZ (§3.3): the gradient reduce-scatter of stages 1-3 as int8
  all-to-alls summed in fp32 by the owner, hierarchically (node first, then across nodes) when
  node groups are given. Asynchronous under ``overlap_comm``, as the plain reduce-scatter.
"""

from __future__ import annotations

import torch

from zerotron.parallel import collectives as C
from zerotron.zero.strategies import PlainGather
from zerotron.zero.zeropp.quantized_comm import quantized_all_gather, quantized_reduce_scatter


class QuantizedGather(PlainGather):
    def __init__(self, layout, group, block: int):
        super().__init__(layout, group)
        self.block = block

    def gather(self, g: int, buf: torch.Tensor, source, backward: bool, async_op: bool) -> list:
        handles = [quantized_all_gather(out, shard, self.group, self.block, async_op=async_op)
                   for out, shard in self.layout.gather_pairs(g, buf, *source.take(g))]
        return handles if async_op else []


class SecondaryGather:
    def __init__(self, forward, secondary):
        self.forward, self.secondary = forward, secondary
        self.to_fill: set[int] = set()  # forward gathers whose result becomes the secondary slice

    def gather(self, g: int, buf: torch.Tensor, source, backward: bool, async_op: bool) -> list:
        sec = self.secondary
        if not sec.layout.groups[g].persistent:  # persistent groups stay gathered: no second copy
            if backward and sec.valid[g]:
                return sec.gather(g, buf, async_op)  # inside the node only
            self.to_fill.add(g)
        return self.forward.gather(g, buf, source, backward, async_op)

    def complete(self, g: int, buf: torch.Tensor) -> None:
        self.forward.complete(g, buf)
        if g in self.to_fill:
            self.to_fill.discard(g)
            self.secondary.fill(g, buf)

    def invalidate(self) -> None:
        self.forward.invalidate()
        self.secondary.invalidate()

    def memory_report(self) -> dict:
        return {"device": {"secondary_params": self.secondary.nbytes()}}


class QuantizedReduceScatter:
    def __init__(self, group, block: int, inner=None, outer=None):
        self.group, self.block, self.inner, self.outer = group, block, inner, outer

    def reduce_scatter(self, out: torch.Tensor, bucket: torch.Tensor, async_op: bool) -> C.Handle:
        done = quantized_reduce_scatter(out, bucket, self.group, self.block, inner=self.inner,
                                        outer=self.outer, async_op=async_op)
        return done if async_op else C.Handle(result=out)
