"""A simulated rank of a large world: fake tensors, the ``fake`` process group, a fake accelerator.

The dry run (``scripts/dry_run.py``) runs the real code -- grid, model, ZeRO optimizer, schedule --
as one rank of, say, 400 GPUs, on a laptop. Three torch tools make that possible:

* ``FakeTensorMode``: tensors carry shape, dtype and device but no data, so a 100B model costs
  nothing to "allocate" and every operator still checks devices and shapes (a CPU tensor meeting a
  device tensor raises ``FakeTensorDeviceMismatchError``, as it would fail on a GPU);
* the ``fake`` process-group backend (``FakeStore``): every collective returns at once, so one
  process can be rank 0 of 400 without the other 399; ``CommStats`` still counts what it would move;
* ``host_sync.simulate()``: device reads return placeholders, driver-only CUDA objects are no-ops.

The device: ``cuda`` when this torch was built with CUDA (torch then puts a no-op CUDA guard under
fake tensors, so no GPU is needed). A CPU-only torch has no CUDA guard to put under autograd, so
there the simulated accelerator is torch's ``PrivateUse1`` backend registered from Python under
the name ``STAND_IN`` -- an accelerator that is not the CPU, which is what the dry run must prove:
that nothing in a step lands on the host. Code that asks ``device.type == "cuda"`` for a driver
feature (streams, pinned memory) takes its CPU branch there, as it does under ``simulate()`` anyway.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

STAND_IN = "fakegpu"


class _StandInModule:
    """What torch asks of a device module (``torch.<name>``): one device, no RNG, no AMP state."""

    @staticmethod
    def get_amp_supported_dtype():
        return [torch.float16, torch.bfloat16]

    is_available = is_initialized = staticmethod(lambda: True)
    device_count = staticmethod(lambda: 1)
    current_device = staticmethod(lambda: 0)
    _is_in_bad_fork = staticmethod(lambda: False)
    manual_seed_all = staticmethod(lambda seed: None)
    get_rng_state = staticmethod(lambda device=None: torch.zeros(8, dtype=torch.uint8))
    set_rng_state = staticmethod(lambda state, device=None: None)


def cuda_is_built() -> bool:
    """Whether this torch has CUDA compiled in (a GPU need not be present)."""
    return torch.backends.cuda.is_built()


def accelerator(kind: str = "cuda") -> torch.device:
    """The device a simulated rank computes on: ``cpu``, ``cuda`` or, on a CPU-only torch asked for
    ``cuda``, the stand-in accelerator (registered once per process; see the module docstring)."""
    if kind == "cpu":
        return torch.device("cpu")
    if kind != "cuda":
        raise ValueError(f"device={kind!r}: use 'cuda' or 'cpu'")
    if cuda_is_built():
        return torch.device("cuda", 0)
    if torch._C._get_privateuse1_backend_name() != STAND_IN:
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend(rename=STAND_IN, backend_module=_StandInModule())
    return torch.device(STAND_IN, 0)


def fake_mode():
    """A ``FakeTensorMode`` that takes real tensors as inputs (host RNG states, numpy data) as fake
    ones on their own device: a real CPU tensor meeting a device tensor still fails with torch's
    device-mismatch error, and the dry run watches for host tensors made inside the step."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def fake_world(rank: int, world_size: int):
    """Be ``rank`` of ``world_size`` for the block: the default group is a ``fake`` one."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_world: a process group already exists in this process; the dry run "
                           "needs its own process (scripts/dry_run.py)")
    devices = ["cpu", "cuda"] + ([STAND_IN] if torch._C._get_privateuse1_backend_name() == STAND_IN else [])
    backend = ",".join(f"{d}:fake" for d in devices)  # p2p looks its backend up by the tensors' device
    dist.init_process_group(backend, store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
