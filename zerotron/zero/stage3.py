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
step, 1.5x plain DP (§7.2.2) -- also with activation checkpointing, whose recompute gathers the
unit that its backward then uses. What autograd saves of a gathered parameter is a handle, not the
buffer, and what stays gathered between uses follows DeepSpeed's ``stage3_max_reuse_distance`` and
``stage3_max_live_parameters`` (``stage3_reuse``). The next units in the order recorded during the
first forward are prefetched asynchronously (in reverse order during backward) within a *window*:
the groups gathered or in flight ahead of the running unit never exceed
``stage3_prefetch_bucket_size`` elements, counted whenever they were gathered (DeepSpeed's
coordinator charges only what each fetch issues, so its window grows by a bucket per fetch).
Unset, the window is one unit, as FSDP2's forward prefetch (``stage3_prefetch.one_unit_window``).
Parameters smaller than ``stage3_param_persistence_threshold`` sit in one *persistent*
group that stays gathered (their gather would cost more in latency than it saves in memory); they
are still partitioned for the optimizer and re-gathered once after each step (2Ψ_small).

Two strategies (``zero.strategies``) are chosen once: the ``ShardSource`` a group's shard is read
from just before its all-gather (memory, or ZeRO-Infinity's file, arXiv 2104.07857, where the
next unit is read ahead when the prefetch budget stops and a shard is dropped once its gather
completes) and the ``Gather`` that moves it (plain, ZeRO++ qwZ's int8 shards or hpZ's secondary
partition, arXiv 2306.10209 §3.1-3.2, which the forward gather fills and the backward one uses).
"""

from __future__ import annotations

import torch
from torch import nn

from zerotron.zero.stage3_prefetch import one_unit_window
from zerotron.zero.stage3_reuse import SavedParamViews, UseTrace, in_backward
from zerotron.zero.strategies import Gather, ShardSource, merge_reports

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
    """Parameter indices each unit uses: those registered on its modules that no other unit nested in
    it encloses. A parameter registered twice (tied: ``blocks[1].ln.weight = ln_f.weight``) belongs to
    every unit that reaches it by a path of its own, so a unit never runs with a tied parameter that
    an inner unit has already released."""
    index = {id(p): i for i, p in enumerate(params)}
    unit_ids = {id(u) for u in units}
    out = []
    for u in units:
        found: dict[int, None] = {}  # insertion-ordered set: the order of ``u.parameters()``
        seen, stack = set(), [u]
        while stack:
            m = stack.pop()
            if id(m) in seen:
                continue
            seen.add(id(m))
            for p in m.parameters(recurse=False):
                if id(p) in index:
                    found.setdefault(index[id(p)])
            stack.extend(reversed([c for c in m.children() if id(c) not in unit_ids]))
        out.append(list(found))
    return out


class ParamGatherer:
    """Gathers, binds, releases and prefetches the partitioned parameters of stage 3."""

    def __init__(self, layout, params, units: list[nn.Module], unit_groups: list[list[int]], model: nn.Module,
                 source: ShardSource, gather: Gather, dtype: torch.dtype, device: torch.device,
                 prefetch_numel: int | None, max_live_numel: int = int(1e9),
                 max_reuse_distance: int = 0):
        self.layout, self.params, self.units = layout, params, units
        self.max_live_numel, self.max_reuse_distance = max_live_numel, max_reuse_distance
        self.source, self.gather = source, gather
        self.backward_phase = False
        self.unit_groups, self.dtype, self.device = unit_groups, dtype, device
        if prefetch_numel is None:  # unset: one unit ahead (the largest one a prefetch can reach)
            prefetch_numel = one_unit_window(layout, units, unit_groups, model)
        self.prefetch_numel = prefetch_numel
        n = len(layout.groups)
        self.full: dict[int, torch.Tensor] = {}
        self.inflight: dict[int, list] = {}
        self.refs, self.bwd_active, self.ready = [0] * n, [False] * n, [0] * n
        self.expected = [sum(1 for p in g.params if params[p].requires_grad) for g in layout.groups]
        self.order: list[int] = []
        self.position: dict[int, int] = {}
        self.recording, self.cursor, self.stack = True, 0, []
        self.views = SavedParamViews(self.full, self._regather)
        self.trace = UseTrace([sum(layout.groups[g].numel for g in gs if not layout.groups[g].persistent)
                               for gs in unit_groups])
        self.empty = torch.empty(0, dtype=dtype, device=device)
        self.index = {id(p): i for i, p in enumerate(params)}
        # the model's hooks wrap the units' -- the root unit (the model itself) included -- so an
        # inference forward's release_all comes after the root's post-hook has dropped its reference
        self.hooks = [model.register_forward_pre_hook(self._model_pre, prepend=True)]
        for ui, u in enumerate(units):
            self.hooks.append(u.register_forward_pre_hook(lambda m, a, ui=ui: self._unit_pre(ui)))
            self.hooks.append(u.register_forward_hook(lambda m, a, out, ui=ui: self._unit_post(ui, out)))
        self.hooks.append(model.register_forward_hook(self._model_post, always_call=True))
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
        buf = torch.empty(self.layout.groups[g].numel, dtype=self.dtype, device=self.device)
        works = self.gather.gather(g, buf, self.source, self.backward_phase, async_op)
        self.full[g] = buf
        self.views.buffers[SavedParamViews.key(buf)] = g
        for p in self.layout.groups[g].params:
            self.params[p].data = self.layout.param_view(buf, p)
        if async_op and works:
            self.inflight[g] = works
        else:
            self._done(g)

    def ensure(self, g: int) -> None:
        """Make group ``g`` resident (waiting for its prefetch if one is in flight)."""
        if g in self.inflight:
            self._complete(g)
        elif g not in self.full:
            self._gather(g, async_op=False)

    def _complete(self, g: int) -> None:
        for w in self.inflight.pop(g):
            w.wait()
        self._done(g)

    def _done(self, g: int) -> None:
        self.source.done(g)
        self.gather.complete(g, self.full[g])

    def release(self, g: int) -> None:
        if g in self.inflight:
            self._complete(g)
        for p in self.layout.groups[g].params:
            self.params[p].data = self.empty
        self._forget(g)
        self.bwd_active[g] = False

    def _forget(self, g: int) -> None:
        buf = self.full.pop(g, None)
        if buf is not None:
            self.views.buffers.pop(SavedParamViews.key(buf), None)

    def _regather(self, g: int) -> torch.Tensor:
        """Group ``g``'s gathered buffer for a saved view unpacked in backward (gathered if released)."""
        self.ensure(g)
        return self.full[g]

    def live_numel(self) -> int:
        return sum(self.layout.groups[g].numel for g in self.full if not self.layout.groups[g].persistent)

    def _keep(self, ui: int) -> bool:
        """DeepSpeed's reuse rule: keep a unit released in forward if it is used again within
        ``max_reuse_distance`` elements of other units and the gathered total stays within the cap."""
        return (self.trace.reused_within(ui, self.max_reuse_distance)
                and self.live_numel() <= self.max_live_numel)

    def release_all(self) -> None:
        """Drop every non-persistent group nobody is using (end of backward, after a step)."""
        for g in list(self.full):
            if not self.layout.groups[g].persistent and self.refs[g] == 0:
                self.release(g)
        self.bwd_active = [False] * len(self.bwd_active)
        self.ready = [0] * len(self.ready)
        self.source.settle()
        self.trace.finish()

    def refresh_persistent(self) -> None:
        """After a step: the persistent params are re-gathered from the updated partitions (and whatever
        the gather strategy derived from the old parameters is invalid until the next forward gather)."""
        self.gather.invalidate()
        for g in self.layout.groups:
            if g.persistent:
                self._forget(g.index)
                self._gather(g.index, async_op=False)

    def _prefetch(self, pos: int, step: int) -> None:
        """Gather the next units ahead while what is gathered or in flight ahead of ``pos`` stays
        within ``prefetch_numel`` elements and everything gathered within ``max_live_numel``,
        reading the first group that does not fit from its source; 0 prefetches nothing, not even
        that read (DeepSpeed skips its NVMe prefetch too when the bucket size is 0)."""
        if self.prefetch_numel <= 0 or self.recording:
            return
        ahead, live, seen, k = 0, self.live_numel(), set(), pos + step
        if step < 0 and pos == 0:
            k = len(self.order) - 1  # the root's output gradient comes first; the last block is next
        while 0 <= k < len(self.order) and k != pos:
            groups = self.unit_groups[self.order[k]]
            for g in groups:
                held = self.refs[g] or self.bwd_active[g]
                if g in seen or self.layout.groups[g].persistent or held:
                    continue  # persistent, or held by a running unit: not ahead of it
                seen.add(g)
                numel = self.layout.groups[g].numel
                if g not in self.full:  # ahead, not yet gathered: gathered if the window has room
                    if ahead + numel > self.prefetch_numel or live + numel > self.max_live_numel:
                        self.source.read_ahead([h for h in groups if h not in self.full
                                                and not self.layout.groups[h].persistent])
                        return  # the source may read this unit's shards while the current one runs
                    live += numel
                    self._gather(g, async_op=True)
                ahead += numel  # gathered earlier or now, in flight or not: the window holds it
            k += step

    # hooks ----------------------------------------------------------------------------------------
    def _model_pre(self, module, args) -> None:
        self.cursor, self.backward_phase = 0, False
        self.trace.begin_microbatch()
        self.views.enter()

    def _model_post(self, module, args, out) -> None:
        self.views.exit()
        if self.recording:
            self.recording = False
            self.position = {ui: i for i, ui in reversed(list(enumerate(self.order)))}
        if not torch.is_grad_enabled():  # inference: nothing will come back for these
            self.trace.discard()
            self.release_all()

    def _unit_pre(self, ui: int) -> None:
        recompute = in_backward()  # activation checkpointing runs the unit again just before its backward
        self.trace.use(ui)
        if recompute:
            pos = self.position.get(ui, 0)
        else:
            pos = self.cursor
            self.cursor += 1
            if self.recording:
                self.order.append(ui)
        self.backward_phase = recompute
        self.stack.append(pos)
        for g in self.unit_groups[ui]:
            self.refs[g] += 1
            if recompute and not self.bwd_active[g]:  # held until its gradients are in, not re-gathered
                self.bwd_active[g], self.ready[g] = True, 0
            self.ensure(g)
        self._prefetch(pos, -1 if recompute else +1)

    def _unit_post(self, ui: int, out):
        pos = self.stack.pop()
        keep = None
        for g in self.unit_groups[ui]:
            self.refs[g] -= 1
            if self.refs[g] == 0 and not self.bwd_active[g] and not self.layout.groups[g].persistent:
                keep = self._keep(ui) if keep is None else keep
                if not keep:
                    self.release(g)
        if torch.is_grad_enabled():
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(lambda grad, ui=ui, pos=pos: self._backward_fetch(ui, pos))
        return None

    def _backward_fetch(self, ui: int, pos: int) -> None:
        self.backward_phase = True
        self.trace.use(ui)
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

    def memory_report(self) -> dict:
        """The source's and the gather strategy's bytes by place, plus the persistent groups held gathered."""
        resident = sum(b.numel() * b.element_size() for g, b in self.full.items() if self.layout.groups[g].persistent)
        return merge_reports(self.source.memory_report(), self.gather.memory_report(),
                             {"device": {"params": resident}})


def _tensors(out):
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _tensors(o)
