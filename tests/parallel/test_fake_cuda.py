"""The fake ``cuda`` device of a CPU-only torch (``parallel/fake_cuda.py``), in a fresh process.

What the dry run relies on: autograd runs backward on fake ``cuda`` tensors, a host tensor meeting
one fails (as it would on a GPU) -- also in an operator that returns nothing, a fused Adam, which
fake tensors alone do not check (``device_mixing``) -- and a driver feature not
routed through ``host_sync`` (here a bare ``torch.cuda.Event``) fails rather than silently working.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from zerotron.parallel import fake_cuda

pytestmark = pytest.mark.skipif(torch.backends.cuda.is_built(), reason="a CUDA torch has a real cuda guard")

PROBE = textwrap.dedent("""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError
    from zerotron.parallel import fake_cuda, host_sync, simulation
    from zerotron.parallel.device_mixing import DeviceMixingError

    assert fake_cuda.active()
    device = simulation.accelerator("cuda")
    with simulation.fake_mode(), host_sync.simulate():
        w = torch.randn(64, 32, device=device, requires_grad=True)
        x = torch.randn(8, 64, device=device)
        y = torch.nn.functional.dropout(x @ w, 0.1).square().sum()
        y.backward()
        print("grad", w.grad.device, tuple(w.grad.shape))
        try:
            w + torch.ones(32)
        except (FakeTensorDeviceMismatchError, DeviceMixingError):
            print("mismatch caught")
        host = [torch.zeros(32) for _ in range(3)]  # a host Adam state fed a device gradient
        try:  # returns nothing: FakeTensorMode alone lets it through
            torch._fused_adamw_([host[0]], [w.grad[0]], [host[1]], [host[2]], [], [torch.ones(())],
                                lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.0, eps=1e-8,
                                amsgrad=False, maximize=False)
        except DeviceMixingError as e:
            print("fused adam mixing caught", "_fused_adamw_" in str(e))
        host[0].copy_(w.grad[0])  # copies and 0-dim host scalars are allowed
        print("copy and scalar", (w * torch.tensor(2.0)).device)
        print("event", host_sync.event(), "stream", host_sync.stream(device), "pinned", host_sync.pinned(device))
    try:
        torch.empty(2, pin_memory=True)
    except RuntimeError:
        print("pinned memory refused")
""")


def test_backward_mismatch_and_driver_features_on_fake_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the build itself, not a cached library
    env = fake_cuda.environ()
    assert fake_cuda.library().parent == tmp_path / "zerotron" and env["LD_PRELOAD"].startswith(str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines == ["grad cuda:0 (64, 32)", "mismatch caught", "fused adam mixing caught True",
                     "copy and scalar cuda:0", "event None stream None pinned False",
                     "pinned memory refused"], proc.stdout


BARE_BACKWARD = textwrap.dedent("""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        w = torch.randn(4, 4, device="cuda", requires_grad=True)
        (w * 2).sum().backward()
""")


def test_without_the_library_cuda_backward_is_what_fails():
    """Why the library exists: the same fake-cuda backward without it aborts inside autograd."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    proc = subprocess.run([sys.executable, "-c", BARE_BACKWARD], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0 and "not linked with support for cuda devices" in proc.stderr, proc.stderr[-2000:]


DEBUG_BARRIER = textwrap.dedent("""
    import torch
    from zerotron.parallel import Grid, ParallelDims, host_sync, simulation
    from zerotron.parallel import collectives as C

    with simulation.fake_world(0, 2), host_sync.simulate(), simulation.fake_mode():
        grid = Grid(ParallelDims())
        grid.health.check_sequence = True  # ZEROTRON_DEBUG_COLLECTIVES=1
        C.barrier(grid.world_group)  # no tensor: the descriptor must go where the group takes them
        C.all_reduce(torch.ones(4, device="cuda"), grid.world_group)
        print("checked", grid.health.counts)
        try:  # the fake group serves cuda only, as NCCL: a host tensor is refused
            C.all_reduce(torch.ones(4), grid.world_group)
        except RuntimeError as e:
            print("refused", "does not serve" in str(e))
""")


def test_the_debug_check_of_a_barrier_runs_on_a_cuda_only_group():
    """``ZEROTRON_DEBUG_COLLECTIVES=1`` on NCCL: a barrier's descriptor was a host tensor, which a
    group without a CPU backend refuses (``No backend type associated with device type cpu``)."""
    proc = subprocess.run([sys.executable, "-c", DEBUG_BARRIER], capture_output=True, text=True,
                          timeout=120, env=fake_cuda.environ())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["checked {'world': 2}", "refused True"], proc.stdout
