"""Metrics: console progress bar, ``<run-dir>/metrics.jsonl`` and wandb, written by global rank 0.

wandb works with no account: the default mode is ``offline`` (files under ``<run-dir>/wandb``,
``wandb sync`` uploads them later); ``online`` without credentials falls back to offline with a
warning instead of prompting for a login on a cluster node.

The training step leaves its values on the device (``parallel.host_sync``); a logged record is
read to the host here, all its tensors in one read (``host_values``), at the log interval only.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from zerotron.parallel import host_sync


def peak_memory(device: torch.device) -> dict[str, int]:
    """Peak memory of this process: allocator peaks on GPU, peak resident set size on CPU."""
    out = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device.type == "cuda":
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    return out


def host_values(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with its tensor values as Python numbers: the one-element tensors stacked and
    read in a single host read (reason ``"log"``; exact through float64 for every float dtype and
    integers below 2**53), any larger tensor read as a list."""
    scalars = [k for k, v in record.items() if isinstance(v, torch.Tensor) and v.numel() == 1]
    out = dict(record)
    for k, v in record.items():
        if isinstance(v, torch.Tensor) and v.numel() != 1:
            out[k] = host_sync.read(v, "log", placeholder=[])
    if not scalars:
        return out
    device = record[scalars[0]].device
    stacked = torch.stack([record[k].detach().reshape(()).to(device=device, dtype=torch.float64) for k in scalars])
    values = host_sync.read(stacked, "log", placeholder=[0.0] * len(scalars) if len(scalars) > 1 else 0.0)
    for k, value in zip(scalars, values if len(scalars) > 1 else [values]):
        dtype = record[k].dtype
        out[k] = bool(value) if dtype == torch.bool else value if dtype.is_floating_point else int(value)
    return out


def _wandb_has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore")


class MetricsLogger:
    """Writes one JSON object per logged step; only the rank with ``enabled=True`` writes."""

    def __init__(self, run_dir: str, config: dict[str, Any], enabled: bool, wandb_mode: str = "offline",
                 project: str = "zerotron", total_steps: int = 0, start_step: int = 0):
        self.enabled = enabled
        self._wandb = None
        self._bar = None
        if not enabled:
            return
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        if wandb_mode != "disabled":
            self._wandb = self._start_wandb(config, wandb_mode, project)
        if sys.stderr.isatty() or os.environ.get("ZEROTRON_PROGRESS"):
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def _start_wandb(self, config: dict, mode: str, project: str):
        if mode == "online" and not _wandb_has_credentials():
            print("[zerotron] wandb: no account configured (WANDB_API_KEY / ~/.netrc); logging offline instead",
                  file=sys.stderr)
            mode = "offline"
        try:
            import wandb
        except ImportError:
            print("[zerotron] wandb is not installed; metrics go to metrics.jsonl only", file=sys.stderr)
            return None
        os.environ.setdefault("WANDB_SILENT", "true")
        return wandb.init(project=project, mode=mode, dir=str(self.run_dir), config=config,
                          name=self.run_dir.name, reinit="finish_previous")

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = host_values(record)
        self._file.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            flat = {k: v for k, v in record.items() if isinstance(v, (int, float))}
            for group, nbytes in (record.get("comm_bytes") or {}).items():
                flat[f"comm_bytes/{group}"] = nbytes
            self._wandb.log(flat, step=record["step"])
        if "eval_loss" in record:
            self.message(f"eval {record['step']:>6} | loss {record['eval_loss']:.4f} | ppl {record['eval_ppl']:.2f}")
            return
        line = (f"step {record['step']:>6} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
                f"grad_norm {record.get('grad_norm', float('nan')):.3f} | tok/s {record.get('tokens_per_s', 0):,.0f} | "
                f"TFLOP/s {record.get('tflops_per_device', 0):.3f}")
        if record.get("loss_scale") is not None and record.get("loss_scale") != 1.0:
            line += f" | scale {record['loss_scale']:.0f}"
        self.message(line)

    def progress(self, steps: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(steps)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


class Throughput:
    """Tokens/s, samples/s, TFLOP/s per device and MFU over the last logging window."""

    def __init__(self, flops_per_step: float, tokens_per_step: int, samples_per_step: int, world_size: int,
                 peak_tflops: float | None):
        self.flops_per_step, self.tokens, self.samples = flops_per_step, tokens_per_step, samples_per_step
        self.world, self.peak = world_size, peak_tflops
        self._t0, self._steps = time.perf_counter(), 0

    def step(self) -> None:
        self._steps += 1

    def read(self) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        n, self._steps, self._t0 = self._steps, 0, time.perf_counter()
        tflops = self.flops_per_step * n / elapsed / self.world / 1e12
        out = {"tokens_per_s": self.tokens * n / elapsed, "samples_per_s": self.samples * n / elapsed,
               "tflops_per_device": tflops, "step_time_s": elapsed / max(n, 1)}
        out["mfu"] = tflops / self.peak if self.peak else None  # None: no peak known for this device
        return out
