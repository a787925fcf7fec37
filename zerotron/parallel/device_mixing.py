"""Fail any operator whose tensor arguments live on different devices, as a GPU would.

A CPU-only test run cannot see a host tensor meeting a device tensor: everything is on the CPU.
The dry run computes on a fake ``cuda`` device, where ``FakeTensorMode`` checks devices -- but only
for operators that return tensors. Operators that return nothing, the in-place foreach and fused
optimizer kernels (``torch._fused_adamw_``), pass it unchecked, so a device gradient fed to a host
Adam went through the dry run and would die at step 1 on a GPU.

``DeviceMixingCheck`` looks at every operator's tensor arguments before it runs, whatever it
returns. Two things mix devices on purpose and are allowed: copies (``copy_``, ``_to_copy`` and
the pinning ops: moving data between devices is their job), and 0-dim CPU tensors, which CUDA
kernels take as scalars.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten
_COPIES = {aten.copy_, aten._to_copy, aten._copy_from, aten._copy_from_and_resize,
           aten.lift_fresh_copy, aten._pin_memory, aten.is_pinned, aten.set_}


class DeviceMixingError(RuntimeError):
    """An operator took tensors on two devices (it would raise, or read garbage, on a GPU)."""


def spanned_devices(func, args, kwargs) -> list[str]:
    """The devices ``func``'s tensor arguments span, when that is more than one and not allowed."""
    if func.overloadpacket in _COPIES or func in _COPIES:
        return []
    devices = set()
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, torch.Tensor) and not (t.device.type == "cpu" and t.dim() == 0):
            devices.add(str(t.device))
    return sorted(devices) if len(devices) > 1 else []


class DeviceMixingCheck(TorchDispatchMode):
    """Raise ``DeviceMixingError`` naming the operator and its devices (module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = spanned_devices(func, args, kwargs)
        if devices:
            shapes = [f"{tuple(t.shape)}@{t.device}" for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor)]
            raise DeviceMixingError(
                f"{func} takes tensors on {' and '.join(devices)} ({', '.join(shapes[:8])}): on a "
                f"GPU this fails or reads the wrong memory; copy to one device first")
        return func(*args, **kwargs)
