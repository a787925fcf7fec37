"""Device, backend and process-group start-up: the one place these choices are made.

CUDA + NCCL when a GPU is visible, CPU + gloo otherwise. ``ZEROTRON_DEVICE`` (``cpu`` or
``cuda``) and ``ZEROTRON_BACKEND`` (``gloo`` or ``nccl``) override the choice, and
``ZEROTRON_COLLECTIVE_TIMEOUT`` (seconds) sets how long a collective may wait before the rank
fails instead of hanging -- a dead or diverged rank then stops the job loudly. The bound is set
on the default group here and copied to every group the ``Grid`` creates
(``group_timeout``): ``new_group`` without one would fall back to torch's 30 minutes.
On a CPU device the host is the device, so glibc is told to return freed large blocks
(``return_freed_host_memory``). ``training.deterministic`` asks for deterministic kernels here
too (``use_deterministic_kernels``): the cuBLAS workspace, torch's flag, the SDPA backends.
"""

from __future__ import annotations

import ctypes
import datetime
import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600.0
# the cuBLAS workspace settings that make its GEMMs reproducible (CUDA's reproducibility notes);
# the first is what torch's error message and torchtitan's debug.deterministic set
DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")


def pick_device(local_rank: int = 0) -> torch.device:
    """The compute device of this process: ``cuda:<local_rank>`` when a GPU exists, else CPU."""
    wanted = os.environ.get("ZEROTRON_DEVICE", "").strip().lower()
    if wanted not in ("", "cpu", "cuda"):
        raise ValueError(f"ZEROTRON_DEVICE={wanted!r}: use 'cpu' or 'cuda'")
    if wanted == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("ZEROTRON_DEVICE=cuda but torch sees no GPU; unset it to run on CPU")
    if wanted == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def pick_backend(device: torch.device) -> str:
    """NCCL for GPUs, gloo for CPUs, unless ``ZEROTRON_BACKEND`` says otherwise."""
    wanted = os.environ.get("ZEROTRON_BACKEND", "").strip().lower()
    if wanted:
        if wanted not in ("gloo", "nccl"):
            raise ValueError(f"ZEROTRON_BACKEND={wanted!r}: use 'gloo' or 'nccl'")
        return wanted
    return "nccl" if device.type == "cuda" else "gloo"


def keep_compiler_cache_in(cache_dir: str | os.PathLike) -> Path:
    """Point torch's compiler cache (``TORCHINDUCTOR_CACHE_DIR``) at ``<cache_dir>/torchinductor``
    unless the user set it, and return where it is.

    torch creates that cache in the system temp dir as soon as ``torch._dynamo`` is imported
    (``torch.optim`` and activation checkpointing import it, ``training.compile`` fills it), and a
    run must not write there by default. Call it before the first such import. On a cluster whose
    ``data.cache_dir`` is on a shared filesystem, set ``TORCHINDUCTOR_CACHE_DIR`` to node-local disk.
    """
    path = os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(cache_dir).resolve() / "torchinductor"))
    return Path(path)


def positive_env(name: str, holds: str) -> float | None:
    """Environment variable ``name`` as a positive finite number, None when unset; a ValueError
    naming it and what it ``holds`` otherwise ('soon', 'nan' and -5 included)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={raw!r} must be a positive number ({holds}); fix or unset it")
    return value


def collective_timeout(seconds: float | None = None) -> datetime.timedelta:
    """Timeout for every collective; the env var wins over the argument so CI can tighten it.
    The one parser of ``ZEROTRON_COLLECTIVE_TIMEOUT``: start-up's check (``config.env_check``)
    calls it, so a bad value is refused with this message before any process group."""
    value = positive_env("ZEROTRON_COLLECTIVE_TIMEOUT",
                         "seconds a collective may wait before the rank fails")
    if value is None:
        value = seconds if seconds is not None else DEFAULT_TIMEOUT_S
    if value <= 0:
        raise ValueError(f"collective timeout must be > 0 seconds, got {value}")
    return datetime.timedelta(seconds=value)


def group_timeout() -> datetime.timedelta:
    """The default process group's timeout, for the groups made after it.

    Read from the group itself, so a launcher that called ``init_process_group`` on its own (the
    test harness, torchrun wrappers) is followed too; ``collective_timeout()`` when torch does not
    expose it."""
    try:
        pg = dist.distributed_c10d._get_default_group()
        for device in (torch.device("cpu"), torch.device("cuda")):
            try:
                return pg._get_backend(device).options._timeout  # private API, present in torch 2.x
            except Exception:  # noqa: BLE001 - no backend for this device type
                continue
    except Exception:  # noqa: BLE001 - no default group or an older torch
        pass
    return collective_timeout()


def emulate_nccl() -> bool:
    """``ZEROTRON_EMULATE_NCCL=1``: a gloo run behaves as NCCL does when a peer dies or freezes --
    no error ever reaches the waiting thread, which stays blocked (as in a CUDA sync) -- so the
    CPU tests and drills see what a GPU cluster sees (``collectives``, ``health``)."""
    return os.environ.get("ZEROTRON_EMULATE_NCCL", "") not in ("", "0")


def nccl_semantics() -> bool:
    """Whether a failed collective is never raised to the waiting thread: NCCL, or its emulation."""
    if emulate_nccl():
        return True
    try:
        return dist.is_initialized() and dist.get_backend() == "nccl"
    except Exception:  # noqa: BLE001 - a default group of several backends, or none
        return False


def gpus_per_node() -> int | None:
    """Processes per node as the launcher says (torchrun's ``LOCAL_WORLD_SIZE``), None if unsaid."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def serves(pg, device: torch.device) -> bool:
    """Whether process group ``pg`` (None: the default group) has a backend for ``device``'s
    tensors: an NCCL group has none for the host ("No backend type associated with device type
    cpu"). Collectives on fake tensors skip that lookup, so the dry run asks here."""
    pg = pg if pg is not None else dist.distributed_c10d._get_default_group()
    try:
        pg._get_backend(torch.device(device.type))  # private API, present in torch 2.x
        return True
    except Exception:  # noqa: BLE001 - no backend registered for this device type
        return False


def collective_device(pg=None) -> torch.device:
    """Where a tensor of the group's own making goes (a barrier's debug descriptor): the host when
    ``pg`` has a CPU backend (gloo), else the current CUDA device (NCCL)."""
    return torch.device("cpu") if serves(pg, torch.device("cpu")) else torch.device("cuda")


@dataclass(frozen=True)
class DistEnv:
    """What a process knows about itself once the default process group exists."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def return_freed_host_memory() -> None:
    """glibc keeps freed large blocks in its heap once its dynamic mmap threshold has grown, so a
    process would hold the allocator's high-water mark, not what is alive: on a CPU device, stage
    3's gathered units (13.5 MiB each at h768), made and freed at every unit, kept its RSS above
    stage 2's. A fixed 1 MiB threshold (``mallopt(M_MMAP_THRESHOLD)``) gives every large tensor its
    own mapping, returned on free; smaller ones stay in the heap as before."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc: RSS is then the allocator's figure
        pass


def use_deterministic_kernels() -> None:
    """``training.deterministic``: every kernel of a step gives the same bits on the same inputs,
    so a resumed run repeats the uninterrupted one bit for bit on a GPU as it does on CPU.

    As Megatron-LM's ``--deterministic-mode`` and torchtitan's ``debug.deterministic`` do:
    ``CUBLAS_WORKSPACE_CONFIG`` before the first cuBLAS handle (cuBLAS reads it when it makes one:
    call this before any CUDA op), ``torch.use_deterministic_algorithms(True)`` -- under which
    SDPA's flash backward accumulates dQ in a fixed order, its memory-efficient backward does not
    split the keys, and an op with no deterministic kernel raises -- and cuDNN's autotuning off.
    SDPA's cuDNN backend, whose backward has no fixed order, is switched off too: torch 2.13
    already skips it under the flag (``check_cudnn_deterministic`` in sdp_utils) and ranks it
    last, so this only makes the choice explicit and visible (``cudnn_sdp_enabled()``).
    ``flex_attention`` (document masks on a GPU) needs nothing: its Triton backward writes dQ per
    query block and dK/dV per key block, without atomics. CPU kernels are deterministic already;
    the same flag is set there. A run with the field false never calls this: torch's defaults."""
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in DETERMINISTIC_CUBLAS:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = DETERMINISTIC_CUBLAS[0]
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.backends.cuda.enable_cudnn_sdp(False)  # whatever a user's sdpa_kernel order says


def init_distributed(timeout_s: float | None = None) -> DistEnv:
    """Start (or join) the default process group from torchrun/SLURM-style env variables.

    Without ``RANK``/``WORLD_SIZE`` (plain ``python script.py``) it starts a group of one so the
    same code path runs single-process. It runs no GEMM and makes no cuBLAS handle, so
    ``use_deterministic_kernels`` may come after it (``build_run`` calls it, before the model).
    """
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(local_rank)
    backend = pick_backend(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # the host is the device: what is freed goes back to the system
        return_freed_host_memory()
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        timeout = collective_timeout(timeout_s)
        store = _restart_store(timeout)
        if store is None:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def _restart_store(timeout: datetime.timedelta):
    """The rendezvous store of a ``torchrun --max-restarts`` restart, under a prefix of its own.

    torchrun shares its rendezvous TCPStore with the workers (``TORCHELASTIC_USE_AGENT_STORE``)
    and keeps the same store across restarts, so a restarted worker can read the previous
    attempt's gloo/NCCL addresses and fail in ``init_process_group`` with "connection refused"
    (pytorch/pytorch#135712; every TP 2 x PP 2 restart in scripts/drill.py did). With one agent
    (one node) ``TORCHELASTIC_RESTART_COUNT`` is the same on every worker, so
    ``restart_<n>/`` isolates each attempt (the heartbeats of ``parallel.health`` included).
    Several agents may count differently (a node that only saw others fail restarts without
    counting), so there this returns None: give torchrun ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
    (a fresh store per attempt) instead."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or restart == 0:
        return None
    if os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        return None
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timeout)
    return dist.PrefixStore(f"zerotron/restart_{restart}", base)  # keys: zerotron/restart_<n>/<key>


def shutdown() -> None:
    """Tear the default group down; safe to call twice."""
    if dist.is_initialized():
        dist.destroy_process_group()


def memory_available(device: torch.device, local_ranks: int = 1) -> tuple[int, str]:
    """``(bytes, where they were read)`` one rank can count on before it starts: the GPU's free
    memory, or on CPU the host's available memory -- within a cgroup's limit when the job runs
    under one (a container, a SLURM ``--mem``) -- shared by the ``local_ranks`` of this node."""
    if device.type == "cuda":  # more ranks than GPUs share theirs (pick_device: local_rank % count)
        free, _ = torch.cuda.mem_get_info(device)
        sharing = max(1, -(-local_ranks // torch.cuda.device_count()))
        share = f", shared by {sharing} ranks" if sharing > 1 else ""
        name = torch.cuda.get_device_name(device)
        return int(free) // sharing, f"free on {name} ({device}){share}"
    avail, where = _meminfo_available(), "MemAvailable in /proc/meminfo"
    limit = _cgroup_room()
    if limit is not None and (avail is None or limit[0] < avail):
        avail, where = limit
    if avail is None:
        return 0, ""
    share = f", shared by {local_ranks} ranks on this host" if local_ranks > 1 else ""
    return avail // max(1, local_ranks), where + share


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


CGROUP = Path("/sys/fs/cgroup")


def _cgroup_file(name: str) -> str | None:
    """The text of ``/sys/fs/cgroup/<name>``, or None where it cannot be read: the one read of
    the cgroup's memory files (a test fakes a container's limit here)."""
    try:
        return (CGROUP / name).read_text().strip()
    except OSError:
        return None


def _cgroup_room() -> tuple[int, str] | None:
    """Limit minus usage of this process's memory cgroup (v2, else v1); None when unlimited."""
    v1 = ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")
    for limit_file, usage_file in (("memory.max", "memory.current"), v1):
        raw, used = _cgroup_file(limit_file), _cgroup_file(usage_file)
        try:
            if raw is None or raw == "max" or int(raw) >= 2**60 or used is None:
                continue
            room = max(0, int(raw) - int(used))
        except ValueError:
            continue
        return room, f"the cgroup limit {CGROUP / limit_file} less its usage"
    return None
