"""Stage 3's prefetch window, in one process: the real ``ParamGatherer`` hooks on a small model,
with a gather that stays "in flight" until waited, so no process group is needed.

The bound checked (issue 40): at every gather and every unit's start, the non-persistent groups
gathered or in flight that no running unit holds -- the ones ahead -- never exceed
``stage3_prefetch_bucket_size`` elements, and all non-persistent gathered groups never exceed
``stage3_max_live_parameters`` beyond the running units. The reference is a count over the
gatherer's own buffers at each moment, not the prefetch walk's bookkeeping.
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from zerotron.zero.partition import Layout
from zerotron.zero.plan import plan_groups
from zerotron.zero.stage3 import ParamGatherer
from zerotron.zero.stage3_prefetch import one_unit_window

WIDTH, BLOCKS = 8, 6


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, width), nn.Linear(width, WIDTH)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, widths):
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block(w) for w in widths)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x + b(x)
        return x.square().sum()


class Source:
    def __init__(self):
        self.reads = []

    def done(self, g):
        pass

    def read_ahead(self, groups):
        self.reads.append(groups)

    def settle(self):
        pass


class Gather:
    """Fills the group's buffer from the true values; async gathers complete only when waited."""

    def __init__(self, flat, layout, check):
        self.flat, self.layout, self.check = flat, layout, check

    def gather(self, g, buf, source, backward, async_op):
        group = self.layout.groups[g]
        buf.copy_(self.flat[group.offset:group.offset + group.numel])
        return [SimpleNamespace(wait=self.check)] if async_op else []

    def complete(self, g, buf):
        self.check()


def _build(window, max_live=10**9, widths=(16,) * BLOCKS):
    torch.manual_seed(0)
    model = Net(widths)
    params = list(model.parameters())
    cfg = SimpleNamespace(stage=3, stage3_param_persistence_threshold=32)  # biases persist
    names = [str(i) for i in range(len(params))]
    groups, persistent, units, unit_groups = plan_groups(model, params, names, None, cfg)
    layout = Layout([p.shape for p in params], groups, 1, 0, 10**6, persistent)
    flat = torch.zeros(layout.full_numel)
    for i, p in enumerate(params):
        layout.param_view(flat, i).copy_(p.detach())
    moments = []

    def check():
        if gatherer is None or not hasattr(gatherer, "hooks"):
            return
        held = [g for g in gatherer.full if not layout.groups[g].persistent]
        in_use = {g for g in held if gatherer.refs[g] or gatherer.bwd_active[g]}
        ahead = sum(layout.groups[g].numel for g in held if g not in in_use)
        running = sum(layout.groups[g].numel for g in in_use)
        moments.append((ahead, running + ahead))

    gatherer = None
    gatherer = ParamGatherer(layout, params, units, unit_groups, model, Source(),
                             Gather(flat, layout, check), torch.float32, torch.device("cpu"),
                             window, max_live)
    real_gather = gatherer._gather
    gatherer._gather = lambda g, async_op: (real_gather(g, async_op), check())
    for u in units:
        u.register_forward_pre_hook(lambda m, a: check())
    return model, gatherer, moments


def _steps(model, gatherer, n=3):
    losses = []
    for _ in range(n):
        loss = model(torch.ones(2, WIDTH))
        loss.backward()
        gatherer.release_all()
        losses.append(loss.item())
        for p in model.parameters():
            p.grad = None
    return losses


def test_default_window_is_one_unit():
    model, gatherer, _ = _build(None, widths=(16, 32, 16))
    block_sizes = [2 * WIDTH * w for w in (16, 32, 16)]  # the two weights; biases persist
    assert gatherer.prefetch_numel == max(block_sizes)
    g = gatherer
    assert one_unit_window(g.layout, g.units, g.unit_groups, model) == max(block_sizes)


@pytest.mark.parametrize("units_ahead", [1, 2, 4, 1.5])
def test_ahead_never_exceeds_the_window(units_ahead):
    block = 2 * WIDTH * 16
    window = int(units_ahead * block)
    model, gatherer, moments = _build(window)
    losses = _steps(model, gatherer)
    assert max(a for a, _ in moments) <= window
    assert max(a for a, _ in moments) == int(units_ahead) * block  # used, not just respected
    ref_model, ref, _ = _build(0)
    assert _steps(ref_model, ref) == losses  # the window changes when, not what


def test_live_cap_bounds_what_is_gathered():
    block = 2 * WIDTH * 16
    root = WIDTH * WIDTH
    cap = root + 3 * block  # root, running block, two ahead (three while the root runs alone)
    model, gatherer, moments = _build(4 * block, max_live=cap)
    _steps(model, gatherer)
    assert max(live for _, live in moments) == cap  # reached, never passed
