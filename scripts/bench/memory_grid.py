"""The memory model against the measured peak over the ablation grid: ZeRO stages 0-3 x
activation checkpointing off / on / Pa / Pa+cpu, at TP 2 x DP 2 and TP 1 x DP 4; stage 3 with
each prefetch window of ``--windows``: 1, 2 and 4 units ahead, and the trainer's defaults
(window unset, i.e. one unit, and the default persistence threshold).

    .venv/bin/python scripts/bench/memory_grid.py              # 42 rows, ~6 min on 2 cores, no bf16
    .venv/bin/python scripts/bench/memory_grid.py --windows 2  # 24 rows, ~3 min
    .venv/bin/python scripts/bench/memory_grid.py --windows 2 --hidden 128  # the test's, 40 s
    .venv/bin/python scripts/bench/memory_grid.py --json       # one object per configuration

Each configuration is built by ``parallelize_gpt`` from a ``RunConfig`` on 4 gloo ranks and
trains ``--steps`` steps; the peak is the last step's live tensor storage (``MemoryTracker``: the
allocator's side, not the optimizer's own sizes), the maximum over ranks. The prediction is
``estimate(setup_from_run_config(...))["before_margin"]`` -- model states, gathered units,
checkpoints, working memory and buffers, without the fragmentation margin a tracker cannot see;
on a CPU the host is the device, so Pa+cpu's host checkpoints are counted there too.
Pa partitions checkpoints over MP ranks (§6.1), so at TP 1 it has nothing to split and its two
rows are skipped (the config refuses it). Exits 1 if any ratio is outside ``1 +- --tolerance``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from zerotron.testing.bench_args import add_gpt_flags, check_gpt, gpt_config, positive_float, positive_int  # noqa: E402
from zerotron.testing.launch import spawn  # noqa: E402

MiB = 1 << 20
CHECKPOINTING = {"off": {}, "on": {"checkpoint_activations": True},
                 "Pa": {"checkpoint_activations": True, "partition_activations": True},
                 "Pa+cpu": {"checkpoint_activations": True, "partition_activations": True, "cpu_checkpointing": True}}
LAYOUTS = ((2, 2), (1, 4))  # (tp, dp)


def window_arg(text: str) -> str:
    """``--windows``: a number of units ahead (1 or more), or ``default``."""
    if text != "default" and not (text.isdigit() and int(text) >= 1):
        raise argparse.ArgumentTypeError(f"{text!r}: give units ahead (1, 2, ...) or 'default'")
    return text


def run_config(a, tp: int, stage: int, ckpt: str, window: str | None = None):
    from zerotron.parallel import ParallelDims
    from zerotron.config.run_config import RunConfig

    cfg = RunConfig()
    cfg.parallel = ParallelDims(tp=tp)
    cfg.zero.stage = stage
    cfg.zero.reduce_bucket_size = cfg.zero.allgather_bucket_size = a.bucket
    if window != "default":  # the trainer's defaults: no window key, the default persistence
        cfg.zero.stage3_param_persistence_threshold = 0
    if stage == 3 and window != "default":
        cfg.zero.stage3_prefetch_bucket_size = int(window) * block_elements(a, tp)
    for key, value in CHECKPOINTING[ckpt].items():
        setattr(cfg.activation_checkpointing, key, value)
    t = cfg.training
    t.precision, t.micro_batch_size, t.global_batch_size = a.precision, a.batch, a.batch * (4 // tp)
    return cfg


def model_cfg(a):
    return gpt_config(a)


def block_elements(a, tp: int) -> int:
    """One block's all-gathered group with every parameter partitioned: its parameters, in chunks
    of the bucket padded to the DP degree (``zero/partition.py``); k of them: a k-unit window."""
    from zerotron.estimate.memory_model import block_params_per_rank
    from zerotron.estimate.stage3_memory import padded_group_numel

    return padded_group_numel(block_params_per_rank(model_cfg(a), tp), a.bucket, 4 // tp)


def configurations(a, tp: int) -> list[tuple[int, str, str | None]]:
    return [(stage, ckpt, window) for stage in (0, 1, 2, 3)
            for ckpt in CHECKPOINTING if tp > 1 or "Pa" not in ckpt
            for window in (a.windows if stage == 3 else [None])]


def key(stage: int, ckpt: str, window: str | None) -> str:
    return f"{stage}/{ckpt}" + (f"/{window}" if window else "")


def worker(a, tp: int) -> dict:
    import gc

    import torch

    from zerotron.parallel import Grid, ParallelDims
    from zerotron.parallel import collectives as C
    from zerotron.training.parallelize import parallelize_gpt
    from zerotron.training.step_memory import StepMemory

    grid = Grid(ParallelDims(tp=tp))
    out = {}
    for stage, ckpt, window in configurations(a, tp):
        cfg = run_config(a, tp, stage, ckpt, window)
        mem = StepMemory(interval=1)
        with mem.construction():
            plan = parallelize_gpt(cfg.validate(grid.world_size), model_cfg(a), grid)
        model, opt = plan.model, plan.optimizer
        mem.register(opt)
        gen = torch.Generator().manual_seed(17 + grid.dp_rank)
        for step in range(1, a.steps + 1):  # the first step of stage 3 records its order of use
            mem.train_step(step, model, opt, torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen))
        rec = mem.record()
        keys = ["mem_peak_bytes"] + [f"mem_{p}_peak_bytes" for p in ("forward", "backward", "step")]
        worst = torch.tensor([float(rec.get(k, 0)) for k in keys], dtype=torch.float64)
        C.all_reduce(worst, grid.world_group, op="max")
        out[key(stage, ckpt, window)] = dict(zip(keys, (int(v) for v in worst)))
        del plan, model, opt
        gc.collect()
    return out


def predicted(a, tp: int, stage: int, ckpt: str, window: str | None) -> dict:
    from zerotron.estimate.memory_model import estimate, setup_from_run_config

    cfg = run_config(a, tp, stage, ckpt, window).validate(4)
    return estimate(setup_from_run_config(cfg, model_cfg(a), 4, backend="gloo", device="cpu"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_gpt_flags(ap, layers=4, hidden=256, vocab=2048, seq=128, min_heads=2)
    ap.add_argument("--batch", type=positive_int, default=2, help="micro-batch per rank")
    ap.add_argument("--steps", type=positive_int, default=2)
    ap.add_argument("--bucket", type=positive_int, default=200_000)
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--tolerance", type=positive_float, default=0.05, help="largest |measured / model - 1| passed")
    ap.add_argument("--windows", type=window_arg, nargs="+", default=["1", "2", "4", "default"],
                    help="stage 3's prefetch windows: units ahead, or 'default' (the trainer's)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench"), help="where the ranks' rendezvous file goes")
    a = ap.parse_args(argv)
    for tp, _ in LAYOUTS:
        check_gpt(ap, a, tp, note=f"the grid runs TP {tp}")
    print(f"GPT {a.layers} x h{a.hidden}, vocab {a.vocab}, seq {a.seq}, micro-batch {a.batch}, {a.precision}, "
          f"4 ranks; MiB, max over ranks, the last step's peak", flush=True)
    print(f"{'layout':>9} {'stage':>5} {'ckpt':>7} {'window':>7} {'fwd':>7} {'bwd':>7} {'step':>7} "
          f"{'peak':>7} {'model':>7} "
          f"{'ratio':>6}", flush=True)
    bad, rows = 0, []
    for tp, dp in LAYOUTS:
        measured = spawn(worker, 4, a, tp, timeout=1800, collective_timeout=120, store_dir=a.out)[0]
        for stage, ckpt, window in configurations(a, tp):
            m, p = measured[key(stage, ckpt, window)], predicted(a, tp, stage, ckpt, window)
            want = p["before_margin"]  # device "cpu": Pa+cpu's host checkpoints are counted in it
            r = m["mem_peak_bytes"] / want
            bad += abs(r - 1) > a.tolerance
            rows.append({"tp": tp, "dp": dp, "stage": stage, "checkpointing": ckpt,
                         "window": window, **m, "predicted_bytes": int(want), "ratio": r})
            print(f"{f'TP{tp}xDP{dp}':>9} {stage:>5} {ckpt:>7} {window or '-':>7} "
                  + " ".join(f"{m[f'mem_{ph}_peak_bytes'] / MiB:7.2f}" for ph in ("forward", "backward", "step"))
                  + f" {m['mem_peak_bytes'] / MiB:7.2f} {want / MiB:7.2f} {r:6.3f}", flush=True)
    if a.json:
        print(json.dumps(rows))
    print(f"{len(rows) - bad} of {len(rows)} within {a.tolerance:.0%}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
