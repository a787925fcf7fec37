"""Context parallelism's memory per rank: the tracker's peak at CP 1, 2 and 4 against the model.

    .venv/bin/python scripts/bench/cp_memory.py                  # seq 1024, no checkpointing
    .venv/bin/python scripts/bench/cp_memory.py --checkpointing  # full recompute
    .venv/bin/python scripts/bench/cp_memory.py --json

Each layout (CP 1 x DP 4, CP 2 x DP 2, CP 4 x DP 1: 4 gloo ranks, TP 1) is built by
``parallelize_gpt`` from a ``RunConfig`` and trains ``--steps`` steps; the peak is the last
step's live tensor storage (``MemoryTracker``: the allocator's side), the maximum over ranks.
The *activation* peak is that peak less what was alive when the step began (parameters,
gradient buffers, optimizer states): what the step's tokens cost, which context parallelism
divides by cp (each rank holds s/cp of them). The model's figure is
``estimate(setup_from_run_config(...))``: ``before_margin`` for the peak, its checkpoints,
working memory and RNG snapshots for the activation peak (``estimate/context_parallel.py``).
Prints each ratio and each CP row's activation peak times cp over CP 1's; exits 1 if a peak is
outside ``1 +- --tolerance`` of the model or a scaled activation peak outside ``1 +-
--scaling-tolerance`` of CP 1's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from zerotron.testing.bench_args import (add_gpt_flags, check_gpt, gpt_config,  # noqa: E402
                                         positive_float, positive_int)
from zerotron.testing.launch import spawn  # noqa: E402

MiB = 1 << 20
LAYOUTS = ((1, 4), (2, 2), (4, 1))  # (cp, dp) on 4 ranks


def model_cfg(a):
    """The measured GPT, without dropout: the ring computes exact probabilities (no attention
    dropout under CP) and the same at every layout."""
    import dataclasses

    return dataclasses.replace(gpt_config(a), dropout=0.0, attention_dropout=0.0)


def run_config(a, cp: int):
    from zerotron.parallel import ParallelDims
    from zerotron.config.run_config import RunConfig

    cfg = RunConfig()
    cfg.parallel = ParallelDims(tp=1, cp=cp)
    cfg.zero.stage = a.stage
    cfg.zero.reduce_bucket_size = cfg.zero.allgather_bucket_size = a.bucket
    cfg.activation_checkpointing.checkpoint_activations = a.checkpointing
    t = cfg.training
    t.precision, t.micro_batch_size, t.global_batch_size = a.precision, a.batch, a.batch * (4 // cp)
    return cfg


def worker(a, cp: int) -> dict:
    import torch

    from zerotron.parallel import Grid
    from zerotron.parallel import collectives as C
    from zerotron.training.parallelize import parallelize_gpt
    from zerotron.training.step_memory import StepMemory

    torch.set_num_threads(1)
    cfg = run_config(a, cp).validate(4)
    grid = Grid(cfg.parallel)
    mem = StepMemory(interval=1)
    plan = parallelize_gpt(cfg, model_cfg(a), grid)
    model, opt = plan.model, plan.optimizer
    mem.register(opt)
    gen = torch.Generator().manual_seed(17 + grid.dp_rank)  # the CP ranks of a sample share it
    for step in range(1, a.steps + 1):
        ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen)
        base = mem.train_step(step, model, opt, ids)  # parameters, gradients, optimizer states
    peak = mem.record()["mem_peak_bytes"]
    worst = torch.tensor([float(peak), float(peak - base)], dtype=torch.float64)
    C.all_reduce(worst, grid.world_group, op="max")
    grid.close()
    return {"peak": int(worst[0]), "activations": int(worst[1])}


def predicted(a, cp: int) -> dict:
    from zerotron.estimate.memory_model import estimate, setup_from_run_config

    cfg = run_config(a, cp).validate(4)
    e = estimate(setup_from_run_config(cfg, model_cfg(a), 4, backend="gloo", device="cpu"))
    return {"peak": e["before_margin"],
            "activations": e["checkpoints_device"] + e["working"] + e["rng_states"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_gpt_flags(ap, layers=4, hidden=128, vocab=1024, seq=1024, min_heads=2)
    ap.add_argument("--batch", type=positive_int, default=1, help="micro-batch per rank")
    ap.add_argument("--steps", type=positive_int, default=2)
    ap.add_argument("--stage", type=int, choices=(0, 1, 2), default=1, help="ZeRO stage")
    ap.add_argument("--checkpointing", action="store_true", help="full activation checkpointing")
    ap.add_argument("--bucket", type=positive_int, default=200_000)
    ap.add_argument("--precision", default="fp32", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--tolerance", type=positive_float, default=0.05,
                    help="largest |measured / model - 1| of a peak passed")
    ap.add_argument("--scaling-tolerance", type=positive_float, default=0.10,
                    help="largest |cp x activation peak / CP 1's - 1| passed")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench"),
                    help="where the ranks' rendezvous file goes")
    a = ap.parse_args(argv)
    check_gpt(ap, a, 1, note="the layouts run TP 1")
    if a.seq % 8:
        ap.error(f"--seq {a.seq}: CP 4 cuts every sequence into 8 chunks; give a multiple of 8")
    print(f"GPT {a.layers} x h{a.hidden}, heads {model_cfg(a).num_heads}, vocab {a.vocab}, "
          f"seq {a.seq}, micro-batch {a.batch}, {a.precision}, ZeRO-{a.stage}, checkpointing "
          f"{'on' if a.checkpointing else 'off'}, 4 ranks; MiB, max over ranks, the last step",
          flush=True)
    print(f"{'layout':>9} {'peak':>8} {'model':>8} {'ratio':>6} {'act':>8} {'model':>8} "
          f"{'ratio':>6} {'act x cp / CP1':>15}", flush=True)
    bad, rows, first = 0, [], None
    for cp, dp in LAYOUTS:
        m = spawn(worker, 4, a, cp, timeout=1800, collective_timeout=120, store_dir=a.out)[0]
        p = predicted(a, cp)
        first = first or m["activations"]
        scaled = m["activations"] * cp / first
        ratio, act_ratio = m["peak"] / p["peak"], m["activations"] / p["activations"]
        bad += abs(ratio - 1) > a.tolerance or abs(scaled - 1) > a.scaling_tolerance
        rows.append({"cp": cp, "dp": dp, "measured": m, "predicted": p, "ratio": ratio,
                     "activation_ratio": act_ratio, "scaled_activations": scaled})
        print(f"{f'CP{cp}xDP{dp}':>9} {m['peak'] / MiB:8.2f} {p['peak'] / MiB:8.2f} {ratio:6.3f} "
              f"{m['activations'] / MiB:8.2f} {p['activations'] / MiB:8.2f} {act_ratio:6.3f} "
              f"{scaled:15.3f}", flush=True)
    if a.json:
        print(json.dumps(rows))
    print(f"{len(rows) - bad} of {len(rows)} within {a.tolerance:.0%} of the model and "
          f"{a.scaling_tolerance:.0%} of 1/cp")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
