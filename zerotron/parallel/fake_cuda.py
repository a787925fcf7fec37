"""A ``cuda`` device for fake tensors on a CPU-only torch: the dry run's GPU when there is none.

Fake tensors (``FakeTensorMode``) can say ``device="cuda"`` on any torch, and forward works; but
autograd's engine asks the CUDA device guard for streams and asks ATen's CUDA hooks whether CUDA
is built, and a CPU-only wheel has neither, so ``backward()`` aborts ("PyTorch is not linked with
support for cuda devices"). A dry run that must prove nothing lands on the host (ZeRO paper §5's
setups on hundreds of GPUs, run on a laptop) needs exactly that backward on ``cuda``.

This module supplies the two missing pieces and nothing more, from torch's own headers: the
device guard is ``c10::impl::FakeGuardImpl<CUDA>`` (torch's test guard: device index and stream
ids held in thread-locals, events complete at once) and the hooks are the default
``at::CUDAHooksInterface`` answering "built", "has CUDA" and one device. Every other hook keeps
the CPU build's default (pinned memory raises), and ``torch.cuda``'s Python API (streams,
events, ``synchronize``, device properties) stays the CPU build's, which refuses; so a driver
feature reached from the step fails loudly unless it goes through ``host_sync``'s no-op switch.
Real CUDA kernels are never reached: fake tensors dispatch to meta functions.

The hooks are read once, while ``import torch`` runs, so the library must be loaded before it:
``environ()`` gives the environment (``LD_PRELOAD``) a process is started with, and
``scripts/dry_run.py`` re-executes itself under it. The library is compiled once per torch
version with the system C++ compiler (``$CXX``, else ``c++``; a few seconds) and cached under
``$XDG_CACHE_HOME/zerotron`` (default ``~/.cache/zerotron``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shlex
import shutil
import subprocess
import threading
from pathlib import Path

SOURCE = r"""
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace {
c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> fake_guard(c10::DeviceType::CUDA);
c10::impl::DeviceGuardImplRegistrar register_guard(c10::DeviceType::CUDA, &fake_guard);

struct FakeCUDAHooks : at::CUDAHooksInterface {
  explicit FakeCUDAHooks(at::CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 1; }
};
}  // namespace

namespace at {
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", FakeCUDAHooks)
}
"""


class FakeCudaUnavailable(RuntimeError):
    """The fake CUDA library cannot be built here (no C++ compiler, or torch has no headers)."""


def _torch_dir() -> Path:
    """torch's install directory, found without importing torch (the library must precede it)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise FakeCudaUnavailable("torch is not installed")
    return Path(spec.origin).parent


def _torch_version(torch_dir: Path) -> str:
    version = torch_dir / "version.py"
    return version.read_text() if version.exists() else ""


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "zerotron"


def _command(compiler: list[str], torch_dir: Path, source: Path, out: Path) -> list[str]:
    include, lib = torch_dir / "include", torch_dir / "lib"
    return [*compiler, "-O1", "-shared", "-fPIC", "-std=c++20", "-w", f"-I{include}", str(source), f"-L{lib}",
            f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu", "-o", str(out)]


def library() -> Path:
    """The compiled library for this torch, built on first use (atomically: a rename into place).
    Raises ``FakeCudaUnavailable`` naming the fix when it cannot be built."""
    torch_dir = _torch_dir()
    found = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not found:
        raise FakeCudaUnavailable("no C++ compiler found ($CXX, c++ or g++): install one (e.g. apt install g++) "
                                  "to dry-run on a fake cuda device with a CPU-only torch, or pass --device cpu")
    compiler = shlex.split(found)
    recipe = " ".join(_command(compiler, torch_dir, Path("SOURCE"), Path("OUT")))
    key = hashlib.sha256((SOURCE + _torch_version(torch_dir) + recipe).encode()).hexdigest()[:16]
    target = cache_dir() / f"fake_cuda-{key}.so"
    if target.exists():
        return target
    if not (torch_dir / "include" / "c10" / "core" / "impl" / "FakeGuardImpl.h").exists():
        raise FakeCudaUnavailable(f"{torch_dir / 'include'} lacks torch's C++ headers; reinstall torch, "
                                  "or pass --device cpu")
    tag = f"{os.getpid()}.{threading.get_ident()}"
    source, partial = target.with_suffix(f".{tag}.cpp"), target.with_suffix(f".{tag}.so")
    cmd = _command(compiler, torch_dir, source, partial)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        source.write_text(SOURCE)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise FakeCudaUnavailable(f"building the fake CUDA library failed ({' '.join(cmd)}):\n"
                                      f"{proc.stderr[-2000:]}\nfix the compiler ($CXX) or pass --device cpu")
        os.replace(partial, target)
    except (OSError, subprocess.SubprocessError) as e:
        raise FakeCudaUnavailable(f"building the fake CUDA library under {target.parent} failed ({e}); set "
                                  f"$XDG_CACHE_HOME to a writable directory, fix $CXX, or pass --device cpu") from None
    finally:
        source.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
    return target


def environ(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default ``os.environ``) with the library preloaded, for a process to start under."""
    env = dict(os.environ if base is None else base)
    path = str(library())
    preload = env.get("LD_PRELOAD", "")
    if path not in preload.split(":"):
        env["LD_PRELOAD"] = f"{path}:{preload}" if preload else path
    return env


def unload_from_children() -> None:
    """Take the library out of this process's ``LD_PRELOAD`` once it is loaded: a child (a shell,
    inductor's compiler, another torch) must not start with torch's libraries forced into it."""
    kept = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p and not Path(p).name.startswith("fake_cuda-")]
    if kept:
        os.environ["LD_PRELOAD"] = ":".join(kept)
    else:
        os.environ.pop("LD_PRELOAD", None)


def active() -> bool:
    """Whether this process runs on the fake CUDA library (loaded before torch, CUDA not built)."""
    import torch

    accelerator = torch.accelerator.current_accelerator()
    return not torch.backends.cuda.is_built() and accelerator is not None and accelerator.type == "cuda"


@contextlib.contextmanager
def device_queries(capability: tuple[int, int] = (7, 0)):
    """Answer the device queries torch's own Python makes of a ``cuda`` tensor (``torch.distributed``
    asks the compute capability before a broadcast, to pick its fp8 path) for the block; a CPU-only
    torch has no driver to ask. ``capability``: the simulated GPU's (default V100's, the paper's)."""
    import torch

    saved = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda device=None: capability
    try:
        yield
    finally:
        torch.cuda.get_device_capability = saved


_KERNELS: list = []  # the torch.library handle registering one_kernel_ops' CUDA kernels, kept alive


def one_kernel_ops() -> list[str]:
    """Give the fake ``cuda`` device the kernels a CUDA build has and a CPU-only one lacks where the
    operator also has a decomposition (``CompositeImplicitAutograd``): without them a cuda tensor
    takes the decomposition above the dispatch modes, so a ``MemoryTracker`` counts every
    temporary of it at once -- ``silu_backward`` (SwiGLU's backward) held five f-wide tensors
    where a GPU's one fused kernel makes one. With a kernel registered, the operator reaches the
    fake tensors as one call and returns one output, as on a GPU. The kernel itself never runs
    (fake tensors dispatch to meta functions); reached with real data, it refuses. Returns the
    operators registered (once per process)."""
    import torch

    if _KERNELS or not active():
        return []
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    names = [n.removeprefix("aten::") for n in torch._C._dispatch_get_all_op_names()
             if n.startswith("aten::") and has(n, "CPU") and has(n, "CompositeImplicitAutograd")
             and not has(n, "CUDA")]
    lib = torch.library.Library("aten", "IMPL")

    def refuse(*args, **kwargs):
        raise RuntimeError("a fake cuda kernel was reached with real data; the dry run computes on "
                           "fake tensors only")

    for name in names:
        lib.impl(name, refuse, "CUDA")
    _KERNELS.append(lib)
    return names
