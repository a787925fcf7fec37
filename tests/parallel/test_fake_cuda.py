"""The fake ``cuda`` device of a CPU-only torch (``parallel/fake_cuda.py``), in a fresh process.

What the dry run relies on: autograd runs backward on fake ``cuda`` tensors, a host tensor meeting
one fails with torch's own device-mismatch error (as it would on a GPU), and a driver feature not
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
        except FakeTensorDeviceMismatchError:
            print("mismatch caught")
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
    assert lines == ["grad cuda:0 (64, 32)", "mismatch caught", "event None stream None pinned False",
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
