"""``gpu_check``'s ``resume`` row: the CPU suite's bit-identical resume, now on the device.

``tests/training/test_trainer.py`` checks on CPU that a run stopped at a checkpoint and resumed
repeats the uninterrupted run bit for bit (losses and, here, final weights too). On a GPU that
holds only with deterministic kernels (``training.deterministic``,
``parallel/runtime.use_deterministic_kernels``): flash attention's backward accumulates dQ over
key blocks in a varying order otherwise. This row is that claim on the device: the trainer's own
``build_run`` and ``Trainer`` (the checkpoint's RNG, data position and optimizer state included)
on one process, bf16 on CUDA (flash attention on sm80+) with dropout, fp32 on CPU.

It runs in a fresh interpreter (``spawn``), because deterministic mode is process-wide and must
be set before the first CUDA op: the other rows keep torch's defaults.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _argv(work: Path, steps: int, precision: str, *extra: str) -> list[str]:
    return ["--config", str(ROOT / "configs" / "tiny.yaml"), "--tp", "1", "--zero-stage", "2",
            "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-steps", str(steps), "--dropout", "0.1", "--model.attention_dropout", "0.1",
            "--precision", precision, "--training.deterministic", "true",
            "--optimizer.warmup_steps", "2", "--wandb-mode", "disabled", "--log-interval", "100",
            "--eval-interval", "0", "--data.cache_dir", str(work / "cache"), *extra]


def _train(argv: list[str], save_at: int | None) -> tuple[list[float], dict]:
    """One run to its ``train_steps``, saving at ``save_at``: its losses and final weights."""
    from zerotron.config.cli import last_wins, parse_config
    from zerotron.parallel.runtime import init_distributed
    from zerotron.training.build_run import build_run
    from zerotron.training.trainer import Trainer

    cfg = parse_config(last_wins(argv)).validate(1)
    run = build_run(cfg, init_distributed())  # deterministic kernels: build_run, before the model
    try:
        trainer, losses = Trainer(run), []
        while trainer.step < cfg.training.train_steps:
            losses.append(float(trainer.train_step()["loss"]))
            if trainer.step == save_at:
                trainer.save()
        weights = {k: v.detach().float().cpu().clone()
                   for k, v in trainer.model.state_dict().items() if isinstance(v, torch.Tensor)}
        run.close_loaders()
        return losses, weights
    finally:
        run.release_lock()
        run.grid.close()


def resume_runs(kind: str, work: str, steps: int, stop: int) -> dict:
    """On the one rank: the uninterrupted run (saving at ``stop``) and the run resumed from that
    checkpoint, each ``steps`` steps; ``kind``: the device type to compute on."""
    import os

    os.environ["ZEROTRON_DEVICE"] = kind  # the launcher pins its ranks to the CPU
    torch.set_num_threads(1)
    root, precision = Path(work), "bf16" if kind == "cuda" else "fp32"
    ck, t0 = root / "ck", time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # the runs' banners: not in the check's table
        full, w_full = _train(_argv(root, steps, precision, "--run-dir", str(root / "full"),
                                    "--save", str(ck), "--load", "none"), stop)
        resumed, w_resumed = _train(_argv(root, steps, precision,
                                          "--run-dir", str(root / "resumed"), "--save", "none",
                                          "--load", str(ck / f"step_{stop:08d}")), None)
    differ = [k for k in w_full if not torch.equal(w_full[k], w_resumed.get(k))]
    return {"full": full, "resumed": resumed, "weights_differ": differ, "deterministic":
            torch.are_deterministic_algorithms_enabled(), "seconds": time.perf_counter() - t0}


def resume_row(device: torch.device, work: str, steps: int = 6, stop: int = 3
               ) -> tuple[dict, list[str]]:
    """Run both in a fresh process; its figures and the failures (a crash is one, with why)."""
    from zerotron.testing.launch import RankFailure, spawn

    for stale in ("ck", "full", "resumed"):  # a previous check's checkpoints would be resumed
        shutil.rmtree(Path(work) / stale, ignore_errors=True)
    try:
        r = spawn(resume_runs, 1, device.type, work, steps, stop, timeout=300,
                  start_method="spawn", store_dir=str(Path(work) / "store"),
                  collective_timeout=120)[0]
    except RankFailure as e:
        return {}, [f"resume on {device.type}: {str(e).strip()[-1500:]}"]
    failures = []
    if r["resumed"] != r["full"][stop:]:
        failures.append(f"resume: steps {stop + 1}-{steps} resumed {r['resumed']} are not the "
                        f"uninterrupted run's {r['full'][stop:]} bit for bit")
    if r["weights_differ"]:
        failures.append(f"resume: final weights differ from the uninterrupted run's in "
                        f"{r['weights_differ'][:5]}")
    return r, failures
