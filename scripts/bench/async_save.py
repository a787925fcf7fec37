"""How long the loop stands still for a checkpoint: synchronous against ``checkpoint.async_save``.

    .venv/bin/python scripts/bench/async_save.py                  # hidden 512, 8 layers, 1 rank
    .venv/bin/python scripts/bench/async_save.py --hidden 1024 --layers 8 --steps 9

Runs ``scripts/pretrain_gpt.py`` twice on one process -- the same model, steps and save interval,
once with synchronous saves and once with ``--checkpoint.async_save true`` -- and reads each save's
``checkpoint_blocking_s`` and ``checkpoint_total_s`` from ``metrics.jsonl``. The saves compared are
the interval saves (the last one waits for its write by design). Prints the medians and the ratio
of the asynchronous save's blocking time to the synchronous save's. Everything goes to a fresh
directory under ``--out`` (default ``runs/bench_async_save``), removed unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEADS = 8  # model.num_heads of the runs
sys.path.insert(0, str(ROOT))

from zerotron.testing.bench_args import check_out_dir, positive_int  # noqa: E402


def run(out: Path, name: str, args: argparse.Namespace, extra: list[str]) -> list[dict]:
    """One training run; its save records (``checkpoint_*``) from metrics.jsonl."""
    run_dir = out / name
    cmd = [sys.executable, str(ROOT / "scripts" / "pretrain_gpt.py"),
           "--config", str(ROOT / "configs" / "tiny.yaml"), "--tp", "1", "--zero-stage", "1",
           "--model.hidden_size", str(args.hidden), "--model.num_layers", str(args.layers),
           "--model.num_heads", str(HEADS), "--seq-length", "32",
           "--micro-batch-size", "1", "--global-batch-size", "1", "--train-steps", str(args.steps),
           "--save-interval", str(args.interval), "--log-interval", "1", "--eval-interval", "0",
           "--wandb-mode", "disabled", "--run-dir", str(run_dir), "--save", str(run_dir / "ck"),
           "--data.cache_dir", str(args.cache)] + extra
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"{name} run failed ({res.returncode}):\n{res.stderr[-3000:]}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "checkpoint_total_s" in r and r["checkpoint_step"] < args.steps]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=positive_int, default=512, help="model.hidden_size")
    p.add_argument("--layers", type=positive_int, default=8, help="model.num_layers")
    p.add_argument("--steps", type=positive_int, default=7, help="training steps of each run")
    p.add_argument("--interval", type=positive_int, default=2, help="steps between saves")
    p.add_argument("--cache", default=str(ROOT / ".cache" / "zerotron"),
                   help="data.cache_dir of the runs")
    p.add_argument("--out", default="runs/bench_async_save", help="parent of the run directories")
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    args = p.parse_args(argv)
    if args.hidden % HEADS:
        p.error(f"--hidden={args.hidden} is not divisible by the model's {HEADS} heads")
    if args.steps <= args.interval:
        p.error(f"--steps {args.steps} leaves no interval save before the last; "
                f"give more than --interval {args.interval}")
    check_out_dir(p, "--out", args.out, "the benchmark's run directories")
    check_out_dir(p, "--cache", args.cache, "the built-in corpus and sample indices")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix="async_save_", dir=args.out))
    try:
        sync = run(out, "sync", args, [])
        bg = run(out, "async", args, ["--checkpoint.async_save", "true"])
        size = sum(f.stat().st_size for f in (out / "sync" / "ck").rglob("*.safetensors")
                   if f.parent.name.startswith("step_"))
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    med = {name: (statistics.median(r["checkpoint_blocking_s"] for r in recs),
                  statistics.median(r["checkpoint_total_s"] for r in recs)) for name, recs in
           (("sync", sync), ("async", bg))}
    print(f"model: hidden {args.hidden}, {args.layers} layers, 1 rank; {len(sync)} interval saves "
          f"per run; shards on disk at the end {size / 2**20:.0f} MiB (the checkpoints kept)")
    print("| save | checkpoint_blocking_s (median) | checkpoint_total_s (median) |")
    print("|---|---:|---:|")
    for name, (blocking, total) in med.items():
        print(f"| {name} | {blocking:.3f} | {total:.3f} |")
    print(f"async blocking / sync blocking: {med['async'][0] / med['sync'][0]:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
