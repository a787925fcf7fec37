"""Metrics: console lines (and a progress bar on a terminal), ``<run-dir>/metrics.jsonl``, wandb
and optionally TensorBoard (both in ``training/tracking.py``), written by global rank 0.

The training step leaves its values on the device (``parallel.host_sync``); a logged record is
read to the host here, all its tensors in one read (``host_values``), at the log interval only.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from zerotron.parallel import host_sync
from zerotron.training import tracking


def peak_memory(device: torch.device) -> dict[str, int]:
    """Peak memory of this process: allocator peaks on GPU, peak resident set size on CPU."""
    out = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device.type == "cuda":
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    return out



def cannot_write(path: Path, error: OSError, run_dir: Path) -> str:
    """Why rank 0 stops on a file of the run directory it cannot write, with the fix that fits
    the error: room for a full disk or quota, a writable mount for a read-only remount."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = f"free space on the file system of logging.run_dir={run_dir}"
    elif error.errno == errno.EROFS:
        fix = f"the file system of logging.run_dir={run_dir} is read-only: remount it writable"
    else:
        fix = f"make logging.run_dir={run_dir} writable"
    return f"cannot write {path} ({error.strerror or error}); {fix}, or give the run another one"

class PeakWindow:
    """The allocator's peaks per log window on CUDA: each ``read`` returns the peaks since the last
    one and resets torch's counters, so ``peak_allocated_bytes`` sits beside the window's other
    figures instead of being the run's lifetime high; ``run`` keeps the highest of all windows for
    the end-of-run summary. ``peak_rss_bytes`` is the process's lifetime peak (no reset exists)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.run: dict[str, int] = {}

    def read(self) -> dict[str, int]:
        out = peak_memory(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.run = {k: max(v, self.run.get(k, 0)) for k, v in out.items()}
        return out

    def run_peaks(self) -> dict[str, int]:
        """The highest of every window and of what came after the last one."""
        last = peak_memory(self.device)
        return {k: max(v, self.run.get(k, 0)) for k, v in last.items()}


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


SUPERSEDED = "metrics.superseded.jsonl"


def _only_writer(run_dir: Path):
    """An open file holding ``flock`` on ``<run_dir>/.metrics.lock`` for this run's life, or None
    when another live run holds it: then its ``metrics.jsonl`` must not be rewritten under it. A
    file system without ``flock`` gives no such guard (the file is then taken as this run's)."""
    handle = open(run_dir / ".metrics.lock", "a")
    try:
        import fcntl

        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    except (ImportError, OSError):
        pass
    return handle


def supersede(path: Path, start_step: int) -> int:
    """Move the records of ``path`` past ``start_step`` to ``metrics.superseded.jsonl`` beside it
    and return how many: a run resumed from step N trains N+1.. again, and one record per step
    is what a plot or an average of the file needs (TensorBoard's ``purge_step`` does the same).
    A line that does not parse (a write cut by a kill) goes with them. The rewrite is atomic."""
    if not path.is_file():
        return 0
    keep, moved = [], []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
            past = not isinstance(rec, dict) or int(rec.get("step", 0)) > start_step
        except (ValueError, TypeError):
            past = True
        (moved if past else keep).append(line)
    if moved:
        with open(path.with_name(SUPERSEDED), "a") as f:
            f.write("".join(line + "\n" for line in moved))
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, path)
    return len(moved)


class MetricsLogger:
    """Writes one JSON object per logged step; only the rank with ``enabled=True`` writes."""

    def __init__(self, run_dir: str, config: dict[str, Any], enabled: bool, wandb_mode: str = "offline",
                 project: str = "zerotron", total_steps: int = 0, start_step: int = 0, tensorboard: bool = False):
        self.enabled = enabled
        self.failed = ""  # why rank 0 could not write the run directory (the trainer stops on it)
        self._wandb = self._tb = self._bar = None
        self.total_steps = total_steps
        if not enabled:
            return
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._writer = _only_writer(self.run_dir)
        moved = supersede(self.run_dir / "metrics.jsonl", start_step) if self._writer else 0
        self._file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        if not self._writer:
            self.message(f"[metrics] another live run writes {self.run_dir / 'metrics.jsonl'}: the records of both "
                         f"interleave there; give this run its own logging.run_dir")
        if wandb_mode != "disabled":
            self._wandb = tracking.start_wandb(self.run_dir, config, wandb_mode, project)
        if tensorboard:
            self._tb = tracking.TensorBoard(self.run_dir, purge_step=start_step + 1)
        if sys.stderr.isatty():  # a bar on a terminal; elsewhere (a log file) each log line says step N/M and the ETA
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
        if moved:
            self.message(f"[metrics] {moved} record(s) of {self.run_dir / 'metrics.jsonl'} past step {start_step} "
                         f"(steps this run trains again, or another run's) moved to {SUPERSEDED}")

    def keep_config(self, config: dict[str, Any]) -> None:
        """Write the run config as ``config.yaml`` beside ``metrics.jsonl`` (the writing rank); a
        full or read-only run directory sets ``failed``, on which every rank stops naming it."""
        if not self.enabled:
            return
        import yaml

        path = self.run_dir / "config.yaml"
        try:
            path.write_text(yaml.safe_dump(config, sort_keys=False))
        except OSError as e:
            self.failed = self.failed or cannot_write(path, e, self.run_dir)

    def log(self, record: dict[str, Any], suffix: str = "") -> None:
        """Write ``record``; its console line ends with ``suffix`` (the run log's elapsed time and ETA)."""
        if not self.enabled:
            return
        record = host_values(record)
        try:
            self._file.write(json.dumps(record) + "\n")
        except OSError as e:  # a full disk: said once, by rank 0, and agreed on by every rank
            self.failed = self.failed or cannot_write(self.run_dir / "metrics.jsonl", e,
                                                      self.run_dir)
            return
        flat = {k: v for k, v in record.items() if isinstance(v, (int, float))}
        for group, nbytes in (record.get("comm_bytes") or {}).items():
            flat[f"comm_bytes/{group}"] = nbytes
        if self._wandb is not None:
            self._wandb.log(flat, step=record["step"])
        if self._tb is not None:
            self._tb.log(flat, record["step"])
        if "checkpoint_total_s" in record:  # a committed save (checkpoint/checkpointer.py): the console
            return  # has said "[checkpoint] saved"; its seconds are for the file and the trackers
        if "eval_loss" in record:
            self.message(f"eval at step {record['step']}/{self.total_steps} | loss {record['eval_loss']:.4f} | ppl {record['eval_ppl']:.2f}")
            return
        line = (f"step {record['step']}/{self.total_steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
                f"grad_norm {record.get('grad_norm', float('nan')):.3f} | tok/s {record.get('tokens_per_s', 0):,.0f} | "
                f"TFLOP/s {record.get('tflops_per_device', 0):.3f}")
        if record.get("mfu") is not None:
            line += f" | MFU {record['mfu']:.1%} | HFU {record['hfu']:.1%}"
        if record.get("loss_scale") is not None and record.get("loss_scale") != 1.0:
            line += f" | scale {record['loss_scale']:.0f}"
        if record.get("skipped_steps"):  # fp16 steps skipped for overflow, over the whole run
            line += f" | skipped {record['skipped_steps']}"
        self.message(line + suffix)

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
        with contextlib.suppress(OSError):  # its last flush may meet the full disk again
            self._file.close()
        if self._writer is not None:
            self._writer.close()  # releases the flock
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()


class Throughput:
    """Tokens/s, samples/s, TFLOP/s per device, MFU and HFU over the last logging window.

    The window's clock runs from the loop's start (``restart``), not from construction, and stops
    while ``paused`` (evaluation, checkpoints), as Megatron stops its interval timer for them:
    otherwise the first window would carry the start-up (wandb, banner) and the one after an
    evaluation its seconds, and ``step_time_s`` would not be a step's time.

    ``tflops_per_device`` and ``hfu`` count the FLOPs the devices did (activation recompute
    included); ``mfu`` only the model's (``model.flops``): recompute makes a step slower without
    training more, so it lowers MFU instead of counting as useful work. Both are None where the
    device's peak is unknown (metrics.jsonl and wandb get both whenever it is known)."""

    def __init__(self, model_flops_per_step: float, hardware_flops_per_step: float, tokens_per_step: int,
                 samples_per_step: int, world_size: int, peak_tflops: float | None):
        self.model_flops, self.hardware_flops = model_flops_per_step, hardware_flops_per_step
        self.tokens, self.samples = tokens_per_step, samples_per_step
        self.world, self.peak = world_size, peak_tflops
        self.restart()

    def restart(self) -> None:
        self._t0, self._steps, self._paused = time.perf_counter(), 0, 0.0

    @contextlib.contextmanager
    def paused(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - start

    @classmethod
    def of_run(cls, cfg, mcfg, world_size: int, device: torch.device) -> "Throughput":
        """The run's FLOPs per step (global batch, vocabulary padded at its TP) and its device's peak:
        ``logging.peak_tflops``, ``ZEROTRON_PEAK_TFLOPS`` or the table for the device and precision."""
        from zerotron.model.flops import device_peak_tflops, flops_per_iteration
        from zerotron.zero.optimizer import DTYPES

        t, tp = cfg.training, cfg.parallel.tp
        ac = cfg.activation_checkpointing
        model = flops_per_iteration(mcfg, t.global_batch_size, mcfg.seq_length, recompute=False, tp=tp)
        hardware = flops_per_iteration(mcfg, t.global_batch_size, mcfg.seq_length, recompute=ac.checkpoint_activations,
                                       tp=tp, selective=ac.recompute_granularity == "selective")
        peak = device_peak_tflops(device, DTYPES[t.precision], cfg.logging.peak_tflops)
        return cls(model, hardware, t.global_batch_size * mcfg.seq_length, t.global_batch_size, world_size, peak)

    def step(self) -> None:
        self._steps += 1

    def read(self) -> dict[str, float | None]:
        elapsed = max(time.perf_counter() - self._t0 - self._paused, 1e-9)
        n = self._steps
        self.restart()
        per_device = n / elapsed / self.world / 1e12
        tflops, model_tflops = self.hardware_flops * per_device, self.model_flops * per_device
        return {"tokens_per_s": self.tokens * n / elapsed, "samples_per_s": self.samples * n / elapsed,
                "tflops_per_device": tflops, "step_time_s": elapsed / max(n, 1),
                "mfu": model_tflops / self.peak if self.peak else None,
                "hfu": tflops / self.peak if self.peak else None}


class CommWindow:
    """Collective bytes per step by group over a logging window, from the grid's shared counters
    (only ever differenced). What runs inside ``excluded`` (evaluation, checkpoints) is left out,
    so a window holds the training steps' own traffic whether or not an evaluation fell in it."""

    def __init__(self, stats):
        self.stats = stats
        self.restart()

    def restart(self) -> None:
        self._mark, self._excluded = self.stats.snapshot(), {}

    @contextlib.contextmanager
    def excluded(self):
        before = self.stats.snapshot()
        try:
            yield
        finally:
            for group, nbytes in self.stats.since(before).bytes_by_group().items():
                self._excluded[group] = self._excluded.get(group, 0) + nbytes

    def read(self, steps: int) -> dict[str, int]:
        """Bytes per step by group since the last read; then starts over."""
        total, excluded = self.stats.since(self._mark).bytes_by_group(), self._excluded
        self.restart()
        net = {g: b - excluded.get(g, 0) for g, b in total.items()}
        return {g: b // max(1, steps) for g, b in net.items() if b > 0}
