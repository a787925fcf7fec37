"""MemoryTracker counts live storages: known allocations, views, frees, autograd's saved tensors,
and agrees with torch's own MemTracker on a plain module's step (an independent tracker)."""

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from zerotron.parallel.memory_tracker import MemoryTracker

MB = 1 << 20


def test_known_allocations_views_and_frees():
    tr = MemoryTracker()
    with tr.phase("forward"):
        a = torch.empty(MB // 4)  # 1 MiB of float32
        v = a.view(-1, 4)  # a view: same storage, not counted again
        b = torch.empty(2 * MB, dtype=torch.uint8)
        assert tr.total() == 3 * MB and tr.current["activations"] == 3 * MB
        del b
        assert tr.total() == MB
    with tr.phase("step"):
        c = torch.empty(MB, dtype=torch.uint8)
        del c
    assert tr.by_phase == {"forward": 3 * MB, "step": 2 * MB}
    assert tr.peak_bytes == 3 * MB and tr.peak_by_category["activations"] == 3 * MB
    tr.register("optimizer_states", [a])  # renaming moves bytes, adds none
    assert tr.current["optimizer_states"] == MB and tr.current["activations"] == 0
    del a, v
    assert tr.total() == 0


def test_saved_for_backward_stays_counted_until_backward():
    tr = MemoryTracker()
    w = nn.Parameter(torch.randn(256, 256))
    tr.register("parameters", [w])
    x = torch.randn(64, 256)
    with tr.phase("forward"):
        y = torch.tanh(x @ w)  # tanh saves its output, mm saves x and w (already counted)
        loss = y.sum()
        del y
    held = tr.current["activations"]
    assert held >= 64 * 256 * 4, held  # the tanh output is alive although no Python name holds it
    with tr.phase("backward"):
        loss.backward()
    del loss
    assert tr.current["activations"] < held  # backward released what forward saved


def test_agrees_with_torch_memtracker_on_a_module_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 128)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # optimizer state exists before measuring, in both trackers
    theirs = MemTracker()
    theirs.track_external(model, opt)
    with theirs:
        step()
    ours = MemoryTracker()
    ours.register("parameters", list(model.parameters()))
    ours.register("optimizer_states", [t for s in opt.state.values() for t in s.values()])
    with ours.phase("step"):
        step()
    peak_theirs = theirs.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert abs(ours.peak_bytes - peak_theirs) <= 0.02 * peak_theirs, (ours.peak_bytes, peak_theirs)
