"""A simulated rank of a large world: fake tensors, the ``fake`` process group, a fake ``cuda`` device.

The dry run (``scripts/dry_run.py``) runs the real code -- grid, model, ZeRO optimizer, schedule --
as one rank of, say, 400 GPUs, on a laptop. Three torch tools make that possible:

* ``FakeTensorMode``: tensors carry shape, dtype and device but no data, so a 100B model costs
  nothing to "allocate"; under it ``DeviceMixingCheck`` fails any operator whose tensors span
  devices, as it would fail on a GPU;
* the ``fake`` process-group backend (``FakeStore``), registered for the ``cuda`` device only, as
  NCCL is: every collective returns at once, so one process can be rank 0 of 400 without the
  other 399; ``CommStats`` still counts what it would move; a host-tensor collective fails;
* ``host_sync.simulate()``: device reads return placeholders, driver-only CUDA objects are no-ops.

The device: ``cuda``. A CUDA build of torch puts its own guard under fake tensors, so no GPU is
needed. A CPU-only torch has no CUDA guard for autograd, so there the process must have been
started on ``fake_cuda``'s library (``fake_cuda.environ()``; ``scripts/dry_run.py`` re-executes
itself under it): then ``cuda`` tensors, autograd included, are what the dry run computes on, and
every ``device.type == "cuda"`` branch of the code -- pinned buffers, side streams, events -- is
taken, reaching the driver only through ``host_sync``'s switch, which makes them no-ops.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from zerotron.parallel import fake_cuda
from zerotron.parallel.device_mixing import DeviceMixingCheck


def cuda_is_built() -> bool:
    """Whether this torch has CUDA compiled in (a GPU need not be present)."""
    return torch.backends.cuda.is_built()


def accelerator(kind: str = "cuda") -> torch.device:
    """The device a simulated rank computes on: ``cpu`` or ``cuda`` (see the module docstring)."""
    if kind == "cpu":
        return torch.device("cpu")
    if kind != "cuda":
        raise ValueError(f"device={kind!r}: use 'cuda' or 'cpu'")
    if not (cuda_is_built() or fake_cuda.active()):
        raise RuntimeError("a fake cuda device on a CPU-only torch needs this process started under "
                           "zerotron.parallel.fake_cuda.environ() (scripts/dry_run.py does it), or use 'cpu'")
    return torch.device("cuda", 0)


@contextlib.contextmanager
def fake_mode():
    """A ``FakeTensorMode`` that takes real tensors as inputs (host RNG states, numpy data) as fake
    ones on their own device, under ``DeviceMixingCheck``: a CPU tensor meeting a device tensor
    fails in every operator, also those that return nothing (``_fused_adamw_``), which fake
    tensors alone let through. The dry run watches for host tensors made inside the step."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_cuda.one_kernel_ops()  # the fake CUDA library: one kernel where a CUDA build has one
    with FakeTensorMode(allow_non_fake_inputs=True), DeviceMixingCheck():
        yield


@contextlib.contextmanager
def fake_world(rank: int, world_size: int, device_type: str = "cuda"):
    """Be ``rank`` of ``world_size`` for the block: the default group is a ``fake`` one serving
    ``device_type`` only."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_world: a process group already exists in this process; the dry run "
                           "needs its own process (scripts/dry_run.py)")
    # cuda only, as NCCL: a collective on a host tensor fails here as it would on a GPU cluster
    backend = "cuda:fake" if device_type == "cuda" else "cpu:fake"
    dist.init_process_group(backend, store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with fake_cuda.device_queries() if fake_cuda.active() else contextlib.nullcontext():
            yield
    finally:
        dist.destroy_process_group()
