"""One rank of a cluster-sized run, simulated on this machine: the real code on fake tensors.

``simulate_rank`` builds the rank's grid, model, ZeRO optimizer and activation checkpointing with
``parallelize_gpt`` -- as the trainer does -- inside ``parallel.simulation`` (fake tensors, the
``fake`` process group, a fake ``cuda`` device) and runs ``training.step.run_step``, the trainer's own
step, on synthetic batches: every micro-batch, the pipeline schedule included. It then assembles
what a checkpoint save would write (``checkpoint.shard_contents``) and keeps its metadata.

What it measures, per rank, never from the optimizer's own sizes:

* memory: ``MemoryTracker`` (every storage alive on the device, by category and by phase), the
  construction's peak and the step's;
* communication: ``CommStats`` per group and per operation, per step (construction's broadcast
  of the initial weights excluded);
* host synchronisations per step (``parallel.host_sync``);
* host tensors: storages created on the CPU inside the step. Without offload a step must make
  none (on a GPU each would be a host round trip); with ZeRO-Offload or Pa+cpu they are the
  offloaded states and checkpoints, reported, not refused.

A device mismatch inside the step raises (``parallel.device_mixing``), as it would on the GPU,
also in operators that return nothing (fused Adam), which fake tensors alone let through.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from zerotron.model import GPTConfig
from zerotron.parallel import host_sync, simulation
from zerotron.parallel.grid import Grid
from zerotron.checkpoint.distributed import shard_contents
from zerotron.config.run_config import RunConfig
from zerotron.training.parallelize import parallelize_gpt
from zerotron.training.step import run_step
from zerotron.training.step_memory import StepMemory


class DryRunError(RuntimeError):
    """The simulated step did something a GPU run must not (a host tensor without offload)."""


class HostTensors(TorchDispatchMode):
    """Records every operator that makes a CPU tensor while the rank computes on a device, and the
    bytes of the host storages they create (each counted once, however often it is written)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}
        self.bytes = 0
        self._seen = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                name = str(func.overloadpacket)
                self.ops[name] = self.ops.get(name, 0) + 1
                storage = t.untyped_storage()
                if storage not in self._seen:
                    self._seen[storage] = True
                    self.bytes += storage.nbytes()
        return out


@dataclass
class RankReport:
    """What ``simulate_rank`` measured on one rank (bytes per rank, figures per step)."""

    rank: int
    coords: dict
    peak_bytes: int
    by_category: dict[str, int]
    by_phase: dict[str, int]
    construction_peak_bytes: int
    comm: dict[str, dict[str, int]]  # group -> {"calls", "bytes"} per step
    comm_ops: dict[str, dict[str, int]]  # "op/group" -> {"calls", "elements", "bytes"} per step
    host_syncs_per_step: float
    host_sync_reasons: dict[str, float]
    host_tensor_ops: dict[str, int]
    host_tensor_bytes_per_step: float
    checkpoint_shard_bytes: int
    num_params: int
    device: str = ""
    group_ranks: dict[str, list[int]] = field(default_factory=dict)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def offloads(cfg: RunConfig) -> bool:
    """Whether the run keeps state in host memory on purpose (ZeRO-Offload/Infinity, Pa+cpu)."""
    z, ac = cfg.zero, cfg.activation_checkpointing
    return (z.optimizer_offload != "none" or z.offload_param_device != "none"
            or (ac.checkpoint_activations and ac.cpu_checkpointing))


def synthetic_batches(cfg: RunConfig, mcfg: GPTConfig, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This DP rank's micro-batches of one step: token ids and labels on the device."""
    shape = (cfg.training.micro_batch_size, mcfg.seq_length)
    out = []
    for _ in range(cfg.num_microbatches):
        x = torch.randint(0, mcfg.vocab_size, shape, device=device)
        out.append((x, torch.randint(0, mcfg.vocab_size, shape, device=device)))
    return out


def _per_step(snapshot: dict, steps: int) -> tuple[dict, dict]:
    by_group: dict[str, dict[str, int]] = {}
    by_op: dict[str, dict[str, int]] = {}
    for key, count in snapshot.items():  # "op/group" -> {"calls", "elements", "bytes"}
        group = key.split("/", 1)[1]
        calls, nbytes = count["calls"] // steps, count["bytes"] // steps
        by_op[key] = {"calls": calls, "elements": count["elements"] // steps, "bytes": nbytes}
        g = by_group.setdefault(group, {"calls": 0, "bytes": 0})
        g["calls"] += calls
        g["bytes"] += nbytes
    return by_group, by_op


def _group_ranks(grid: Grid) -> dict[str, list[int]]:
    """Members of every group this rank communicates in, ZeRO++'s node-split groups included."""
    groups = {"tp": grid.tp_group, "dp": grid.dp_group, "pp": grid.pp_group, "mp": grid.mp_group,
              "world": grid.world_group, "embedding": grid.embedding_group}
    if grid.cp_size > 1:  # context parallelism: the ring, and DP x CP (gradients, ZeRO)
        groups.update(cp=grid.cp_group, dp_cp=grid.dp_cp_group)
    for split in grid._split_cache.values():
        groups.update({g.name: g for g in split})
    return {name: list(g.ranks) for name, g in groups.items() if g is not None}


def simulate_rank(cfg: RunConfig, mcfg: GPTConfig, world_size: int, rank: int, steps: int = 1,
                  device_kind: str = "cuda", metadata_dir: Path | None = None) -> RankReport:
    """Build and run ``steps`` training steps of ``rank`` in a world of ``world_size`` (see the
    module docstring). ``cfg`` must be validated for ``world_size``. ``metadata_dir``: where the
    checkpoint shard's metadata (``rank_<r>.json``: index, parameter shapes, tensor sizes) goes."""
    if steps < 1:
        raise ValueError(f"steps={steps}: simulate at least one step")
    device = simulation.accelerator(device_kind)
    start = time.perf_counter()
    world = simulation.fake_world(rank, world_size, device.type)
    with world, host_sync.simulate(), simulation.fake_mode():
        grid = Grid(cfg.parallel)
        try:
            memory = StepMemory(1, device_type=device.type)
            with memory.construction():
                plan = parallelize_gpt(cfg, mcfg, grid, device=device, layout_independent_init=False)
            memory.register(plan.optimizer)
            construction = memory.tracker.by_phase["construction"]
            memory.tracker.reset_peaks()
            mark = grid.stats.snapshot()
            host, worst = HostTensors(), None
            with host_sync.counting() as syncs:
                for k in range(steps):
                    batches = synthetic_batches(cfg, mcfg, device)
                    memory.begin_step(k + 1, plan.optimizer)
                    with host:
                        run_step(plan.model, plan.optimizer, batches, grid, cfg.parallel.pipeline_schedule, memory)
                    step_report = memory.tracker.report()  # begin_step starts each step's peak afresh
                    if worst is None or step_report["peak_bytes"] > worst["peak_bytes"]:
                        worst = step_report
            if host.ops and device.type != "cpu" and not offloads(cfg):
                raise DryRunError(f"rank {rank}: the step made tensors on the host without any offload configured "
                                  f"({host.ops}); on a GPU each is a device-to-host copy in the hot path")
            comm, comm_ops = _per_step(grid.stats.since(mark).snapshot(), steps)
            tensors, meta, _ = shard_contents(plan.model, plan.optimizer, grid, {})
            shard_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
            if metadata_dir is not None:
                metadata_dir.mkdir(parents=True, exist_ok=True)
                meta["tensors"] = {k: {"dtype": str(t.dtype), "shape": list(t.shape)} for k, t in tensors.items()}
                (metadata_dir / f"rank_{rank:05d}.json").write_text(json.dumps(meta))
            return RankReport(
                rank=rank, coords=dict(grid.coords), peak_bytes=worst["peak_bytes"],
                by_category=worst["by_category"], by_phase=worst["by_phase"],
                construction_peak_bytes=construction, comm=comm, comm_ops=comm_ops,
                host_syncs_per_step=syncs.total / steps,
                host_sync_reasons={r: n / steps for r, n in syncs.by_reason.items()},
                host_tensor_ops=host.ops, host_tensor_bytes_per_step=host.bytes / steps,
                checkpoint_shard_bytes=shard_bytes, num_params=plan.optimizer.num_params,
                device=str(device), group_ranks=_group_ranks(grid), seconds=time.perf_counter() - start)
        finally:
            grid.close()
