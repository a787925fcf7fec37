"""Pos+g+p (ZeRO §5.3): parameters partitioned, gathered per unit just in time, released after use.

Each rank keeps only its shard of every 16-bit parameter (the flat partition). A *unit* is a
submodule: by default the model itself (for everything outside containers) plus each member of
its ``ModuleList``/``ModuleDict``/``Sequential`` containers such as ``blocks`` (see
``default_units``). Its layout group is all-gathered

* in forward, by a forward pre-hook, and released by the forward hook once the unit has run;
* in backward, by a hook on the unit's output tensors (it fires when the output's gradient
  arrives, i.e. just before the unit's backward), and released once every parameter of the group
  has its gradient (post-accumulate hooks) -- which is when autograd no longer needs it.

That is one all-gather in forward and one in backward, plus the gradient reduce-scatter: 3Ψ per
step, 1.5x plain DP (§7.2.2). The next units in the order recorded during the first forward are
prefetched asynchronously up to ``stage3_prefetch_bucket_size`` elements (in reverse order during
backward). Parameters smaller than ``stage3_param_persistence_threshold`` sit in one *persistent*
group that stays gathered (their gather would cost more in latency than it saves in memory); they
are still partitioned for the optimizer and re-gathered once after each step (2Ψ_small).

ZeRO++ (``hpz.py``): with qwZ every gather moves int8 block-quantized shards (``quantized_all_gather``,
synchronous, so a prefetch of a quantized group completes at issue); with hpZ the forward gather
fills the rank's secondary slice and the backward gather runs over the node-local group only.

ZeRO-Infinity (``nvme_params``, arXiv 2104.07857): with ``disk`` the partition lives in a file; a
group's shard is read just before its all-gather (the next unit's read ahead where the prefetch
budget stops) and dropped once the gather completes.
"""

from __future__ import annotations

import torch
from torch import nn

from zerotron.parallel import collectives as C
from zerotron.zero.hpz import SecondaryPartition
from zerotron.zero.quantized_comm import quantized_all_gather

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def default_units(model: nn.Module) -> list[nn.Module]:
    """The model itself, then every member of its ``ModuleList``/``ModuleDict``/``Sequential`` containers.

    The root unit holds every parameter outside those containers (embeddings, final LayerNorm,
    head): a tied output layer uses the word embedding in the root's own forward (GPT's ``head``),
    so the embedding must stay gathered for the whole forward and again for the whole backward.
    Each transformer block is its own unit, gathered only while it runs.
    """
    units: list[nn.Module] = [model]

    def visit(container: nn.Module) -> None:
        for member in container.children():
            if isinstance(member, _CONTAINERS):
                visit(member)
            elif any(True for _ in member.parameters()):
                units.append(member)

    for child in model.children():
        if isinstance(child, _CONTAINERS):
            visit(child)
    return units


def unit_params(units: list[nn.Module], params: list[nn.Parameter]) -> list[list[int]]:
    """Parameter indices each unit uses: all parameters reachable from it, minus those of units nested in it."""
    index = {id(p): i for i, p in enumerate(params)}
    reach = [[index[id(p)] for p in u.parameters() if id(p) in index] for u in units]
    out = []
    for ui, u in enumerate(units):
        inner = set()
        for vi, v in enumerate(units):
            if vi != ui and v is not u and any(m is v for m in u.modules()):
                inner.update(reach[vi])
        out.append([p for p in reach[ui] if p not in inner])
    return out


class ParamGatherer:
    """Gathers, binds, releases and prefetches the partitioned parameters of stage 3."""

    def __init__(self, layout, params, units: list[nn.Module], unit_groups: list[list[int]], model: nn.Module,
                 part_param: torch.Tensor, dp_group, prefetch_numel: int, zeropp=None, disk=None):
        self.layout, self.params, self.units = layout, params, units
        self.disk, self.staged = disk, {}  # ZeRO-Infinity (nvme_params): shards read from a file, kept to the gather's end
        self.qwz_block = zeropp.block if zeropp is not None and zeropp.qwz else None
        self.secondary = None  # hpZ
        if zeropp is not None and zeropp.hpz_group is not None:
            self.secondary = SecondaryPartition(layout, zeropp.hpz_group, dp_group.ranks[layout.rank],
                                                part_param.dtype, part_param.device)
        self.backward_phase = False
        self.pending_fill: set[int] = set()
        self.unit_groups, self.part, self.dp_group = unit_groups, part_param, dp_group
        self.prefetch_numel = prefetch_numel
        n = len(layout.groups)
        self.full: dict[int, torch.Tensor] = {}
        self.inflight: dict[int, list] = {}
        self.refs, self.bwd_active, self.ready = [0] * n, [False] * n, [0] * n
        self.expected = [sum(1 for p in g.params if params[p].requires_grad) for g in layout.groups]
        self.order: list[int] = []
        self.recording, self.cursor, self.stack = True, 0, []
        self.empty = torch.empty(0, dtype=part_param.dtype, device=part_param.device)
        self.index = {id(p): i for i, p in enumerate(params)}
        self.hooks = [model.register_forward_pre_hook(self._model_pre, prepend=True),
                      model.register_forward_hook(self._model_post)]
        for ui, u in enumerate(units):
            self.hooks.append(u.register_forward_pre_hook(lambda m, a, ui=ui: self._unit_pre(ui)))
            self.hooks.append(u.register_forward_hook(lambda m, a, out, ui=ui: self._unit_post(ui, out)))
        for p in params:
            if p.requires_grad:
                self.hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        for g in layout.groups:
            if g.persistent:
                self.ensure(g.index)
            else:
                self.release(g.index)

    # gather / release -------------------------------------------------------------------------------
    def _gather(self, g: int, async_op: bool) -> None:
        group = self.layout.groups[g]
        buf = torch.empty(group.numel, dtype=self.part.dtype, device=self.part.device)
        works, src = [], None
        sec = self.secondary if not group.persistent else None
        if sec is not None and self.backward_phase and sec.valid[g]:
            works = sec.gather(g, buf, async_op)  # hpZ: backward gather inside the node only
            sec = None
        else:
            src, base = (self.part, 0) if self.disk is None else self.disk.take(g)  # ZeRO-Infinity: from disk
            for ci in group.chunks:
                c = self.layout.chunks[ci]
                out = buf[c.offset - group.offset:c.offset - group.offset + c.numel]
                shard = src[c.part_offset - base:c.part_offset - base + c.shard]
                if self.qwz_block is not None:  # qwZ: int8 + per-block scales on the wire
                    quantized_all_gather(out, shard, self.dp_group, self.qwz_block)
                else:
                    works.append(C.all_gather(out, shard, self.dp_group, async_op=async_op))
        self.full[g] = buf
        if sec is not None:  # hpZ: keep this rank's secondary slice of what the full gather delivers
            if async_op and works:
                self.pending_fill.add(g)
            else:
                sec.fill(g, buf)
        for p in group.params:
            self.params[p].data = self.layout.param_view(buf, p)
        if async_op:
            self.inflight[g] = works
            if src is not None and self.disk is not None:
                self.staged[g] = src  # the disk shard must outlive the async gather reading it

    def ensure(self, g: int) -> None:
        """Make group ``g`` resident (waiting for its prefetch if one is in flight)."""
        if g in self.inflight:
            self._complete(g)
        elif g not in self.full:
            self._gather(g, async_op=False)

    def _complete(self, g: int) -> None:
        for w in self.inflight.pop(g):
            w.wait()
        self.staged.pop(g, None)  # ZeRO-Infinity: the shard read from disk is released after the gather
        if g in self.pending_fill:
            self.pending_fill.discard(g)
            self.secondary.fill(g, self.full[g])

    def release(self, g: int) -> None:
        if g in self.inflight:
            self._complete(g)
        for p in self.layout.groups[g].params:
            self.params[p].data = self.empty
        self.full.pop(g, None)
        self.bwd_active[g] = False

    def release_all(self) -> None:
        """Drop every non-persistent group nobody is using (end of backward, after a step)."""
        for g in list(self.full):
            if not self.layout.groups[g].persistent and self.refs[g] == 0:
                self.release(g)
        self.bwd_active = [False] * len(self.bwd_active)
        self.ready = [0] * len(self.ready)
        if self.disk is not None:
            self.disk.drop_pending()  # no gather until the next forward; the step may rewrite the file

    def refresh_persistent(self) -> None:
        """After a step: the persistent params are re-gathered from the updated partitions (and the hpZ
        secondary copy, derived from the old parameters, is invalid until the next forward gather)."""
        if self.secondary is not None:
            self.secondary.invalidate()
        for g in self.layout.groups:
            if g.persistent:
                self.full.pop(g.index, None)
                self._gather(g.index, async_op=False)

    def _prefetch(self, pos: int, step: int) -> None:
        budget, k = self.prefetch_numel, pos + step
        if step < 0 and pos == 0:
            k = len(self.order) - 1  # the root's output gradient comes first; the last block is next
        while 0 <= k < len(self.order) and k != pos and not self.recording:
            for g in self.unit_groups[self.order[k]]:
                if g in self.full or self.layout.groups[g].persistent:
                    continue
                numel = self.layout.groups[g].numel
                if numel > budget:
                    if self.disk is not None:  # ZeRO-Infinity: read this unit's shards while the current one runs
                        self.disk.read_ahead([h for h in self.unit_groups[self.order[k]]
                                              if h not in self.full and not self.layout.groups[h].persistent])
                    return
                budget -= numel
                self._gather(g, async_op=True)
            k += step

    # hooks ----------------------------------------------------------------------------------------
    def _model_pre(self, module, args) -> None:
        self.cursor, self.backward_phase = 0, False

    def _model_post(self, module, args, out) -> None:
        self.recording = False
        if not torch.is_grad_enabled():  # inference: nothing will come back for these
            self.release_all()

    def _unit_pre(self, ui: int) -> None:
        pos = self.cursor
        self.cursor += 1
        self.backward_phase = False
        self.stack.append(pos)
        if self.recording:
            self.order.append(ui)
        for g in self.unit_groups[ui]:
            self.refs[g] += 1
            self.ensure(g)
        self._prefetch(pos, +1)

    def _unit_post(self, ui: int, out):
        pos = self.stack.pop()
        for g in self.unit_groups[ui]:
            self.refs[g] -= 1
            if self.refs[g] == 0 and not self.bwd_active[g] and not self.layout.groups[g].persistent:
                self.release(g)
        if torch.is_grad_enabled():
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(lambda grad, ui=ui, pos=pos: self._backward_fetch(ui, pos))
        return None

    def _backward_fetch(self, ui: int, pos: int) -> None:
        self.backward_phase = True
        for g in self.unit_groups[ui]:
            if not self.bwd_active[g]:
                self.bwd_active[g], self.ready[g] = True, 0
            self.ensure(g)
        self._prefetch(pos, -1)

    def _on_grad(self, param) -> None:
        g = self.layout.param_group[self.index[id(param)]]
        self.ready[g] += 1
        group = self.layout.groups[g]
        if self.ready[g] >= self.expected[g] and self.refs[g] == 0 and not group.persistent and g in self.full:
            self.release(g)

    def secondary_bytes(self) -> int:
        return 0 if self.secondary is None else self.secondary.nbytes()

    def resident_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for g, b in self.full.items() if self.layout.groups[g].persistent)


def _tensors(out):
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _tensors(o)
