"""Memory of ZeRO stages 0-3 measured from the allocator's side, against the memory model.

    .venv/bin/python scripts/bench/memory.py --ranks 4 --layers 12 --hidden 768 --steps 2
    .venv/bin/python scripts/bench/memory.py --stages 2 3 --prefetch 1 2 4 default

A GPT where parameters dominate (default 12 layers x h 768, vocab 8192, seq 128, micro-batch 1,
bf16), built by ``parallelize_gpt`` on ``--ranks`` gloo processes, one configuration at a time.
Per stage it prints, from ``MemoryTracker`` (live storages, not the optimizer's own sizes): the
peak by phase (construction, forward, backward, step) and by category at the step's peak; the
memory model's prediction (``estimate``: model states + buffers + working memory, before its
fragmentation margin) and measured/predicted; the OS peak RSS of the rank (``ru_maxrss``, which
includes the interpreter and torch, ~the same for every stage; glibc is told to return freed
large blocks, as the trainer does on a CPU device: ``parallel.runtime.return_freed_host_memory``)
and ``memory_report``'s model states for comparison.
Stage 3 runs once per ``--prefetch`` window: units ahead (0: none), or ``default``, the trainer's
defaults (the window unset, i.e. one unit, and the default persistence threshold); a window of two
or more units is the case whose growth went unseen (issue 40).
Figures are the maximum over ranks. With stages 2 and 3 it then checks each stage-3 forward peak,
construction peak and RSS against stage 2 (``stage3_checks``); a check that says NO makes the
script exit 1, naming it, so a failed bound cannot pass unread. Bad flags exit 2 before any rank.
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

from zerotron.parallel.runtime import return_freed_host_memory
from zerotron.testing.bench_args import add_gpt_flags, check_gpt, gpt_config, positive_int
from zerotron.testing.launch import spawn

ROOT = Path(__file__).resolve().parents[2]
STORE = str(ROOT / "runs" / "bench")  # the ranks' rendezvous files: under the checkout, whatever the cwd

MiB = 1 << 20


def worker(args, stage: int, window: str | None) -> dict:
    import torch

    if not args.malloc_as_is:
        return_freed_host_memory()

    from zerotron.parallel import Grid, ParallelDims
    from zerotron.config.run_config import RunConfig
    from zerotron.training.parallelize import parallelize_gpt
    from zerotron.training.step_memory import StepMemory

    grid = Grid(ParallelDims())
    cfg = model_cfg(args)
    run = RunConfig()
    run.zero.stage, run.zero.reduce_bucket_size, run.zero.allgather_bucket_size = stage, args.bucket, args.bucket
    if window != "default":  # the trainer's defaults: no window key, the default persistence
        run.zero.stage3_param_persistence_threshold = 0
        run.zero.stage3_prefetch_bucket_size = prefetch_elements(args, window)
    run.training.precision, run.training.micro_batch_size = args.precision, 1
    run.training.global_batch_size = grid.dp_size
    mem = StepMemory(interval=1)
    with mem.construction():
        plan = parallelize_gpt(run.validate(grid.world_size), cfg, grid)
    model, opt = plan.model, plan.optimizer
    mem.register(opt)
    g = torch.Generator().manual_seed(grid.rank)
    for step in range(1, args.steps + 1):
        mem.train_step(step, model, opt, torch.randint(0, args.vocab, (1, args.seq), generator=g))
    out = mem.record()
    out["rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out["model_states"] = opt.memory_report()["total_model_states"]
    out["psi"] = opt.num_params
    return out


def model_cfg(args):
    return gpt_config(args)


def block_elements(args) -> int:
    """A block's all-gathered group with every parameter partitioned: its parameters in chunks of
    the bucket, each padded to the DP degree (``zero/partition.py``)."""
    from zerotron.estimate.memory_model import block_params_per_rank
    from zerotron.estimate.stage3_memory import padded_group_numel

    return padded_group_numel(block_params_per_rank(model_cfg(args)), args.bucket, args.ranks)


def prefetch_arg(text: str) -> str:
    """``--prefetch``: units ahead (0: no prefetch), or ``default``."""
    if text != "default" and not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: give units ahead (0, 1, 2, ...) or 'default'")
    return text


def prefetch_elements(args, window: str) -> int:
    """``window`` units ahead, in elements (0 units: no prefetch)."""
    return int(window) * block_elements(args)


def cases(args) -> list[tuple[int, str | None]]:
    return [(stage, window) for stage in args.stages
            for window in (args.prefetch if stage == 3 else [None])]


def predicted(args, stage: int, window: str | None) -> float:
    from zerotron.estimate.memory_model import Setup, estimate

    cfg = model_cfg(args)
    stage3 = {}
    if window and window != "default":
        stage3 = dict(prefetch_bucket_size=prefetch_elements(args, window), persistence_threshold=0)
    e = estimate(Setup(cfg, dp=args.ranks, micro_batch=1, stage=stage, checkpoint_activations=False,
                       contiguous_memory=False, precision=args.precision, bucket_size=args.bucket,
                       backend="gloo", device="cpu", **stage3))
    return e["total"] * (1 - e["fragmentation_margin"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=positive_int, default=4)
    add_gpt_flags(ap, layers=12, hidden=768, vocab=8192, seq=128)
    ap.add_argument("--steps", type=positive_int, default=2)
    ap.add_argument("--bucket", type=positive_int, default=5_000_000)
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=(0, 1, 2, 3))
    ap.add_argument("--prefetch", type=prefetch_arg, nargs="+", default=["1", "2", "default"],
                    help="stage 3's windows: blocks gathered ahead, or 'default' (the trainer's)")
    ap.add_argument("--malloc-as-is", action="store_true",
                    help="leave glibc's dynamic mmap threshold on (RSS then keeps freed blocks)")
    args = ap.parse_args(argv)
    check_gpt(ap, args)
    phases = ("construction", "forward", "backward", "step")
    cats = ("parameters", "gradients", "optimizer_states", "activations", "temporaries", "other")
    print(f"GPT {args.layers} x h{args.hidden}, vocab {args.vocab}, seq {args.seq}, micro-batch 1, {args.precision}, "
          f"DP {args.ranks}; MiB, max over ranks; peak by category at the step's peak", flush=True)
    print(f"{'stage':>9} " + " ".join(f"{p[:6]:>7}" for p in phases) + "  "
          + " ".join(f"{c[:6]:>7}" for c in cats)
          + f" {'peak':>7} {'model':>7} {'ratio':>6} {'RSS':>7} {'states':>7}")
    rows: dict = {}
    for stage, window in cases(args):
        results = spawn(worker, args.ranks, args, stage, window, timeout=1800, store_dir=STORE)
        label = f"3/{window}" if window else str(stage)

        def top(key):
            return max(r.get(key, 0) for r in results) / MiB
        pred = predicted(args, stage, window) / MiB
        row = " ".join(f"{top(f'mem_{p}_peak_bytes'):7.1f}" for p in phases)
        row += "  " + " ".join(f"{top(f'mem_peak_{c}'):7.1f}" for c in cats)
        peak = top("mem_peak_bytes")
        print(f"{label:>9} {row} {peak:7.1f} {pred:7.1f} {peak / pred:6.2f} "
              f"{top('rss_bytes'):7.0f} "
              f"{top('model_states'):7.1f}", flush=True)
        rows[label] = {"forward": top("mem_forward_peak_bytes"), "rss": top("rss_bytes"),
                       "step": top("mem_step_peak_bytes"),
                       "states": top("model_states"), "construction": top("mem_construction_peak_bytes"),
                       "step_peak": max(top(f"mem_{p}_peak_bytes") for p in phases[1:]),
                       "activations": top("mem_peak_activations"), "psi": results[0]["psi"]}
    failed = stage3_checks(args, rows)
    if failed:
        print(f"memory.py: FAILED check(s): {', '.join(failed)} (the NO lines above)", file=sys.stderr)
    return 1 if failed else 0


def stage3_checks(args, rows: dict) -> list[str]:
    """Issue-15 and issue-40 bounds, for each stage-3 window: the forward peak against the model
    states + the root unit and the running block with the window's blocks ahead + activations, and
    the whole-run RSS against stage 2's. Returns the checks that failed."""
    failed = []
    for window in args.prefetch if 3 in args.stages else []:
        failed += _checks_of(args, rows, window)
    return failed


def _checks_of(args, rows: dict, window: str) -> list[str]:
    from zerotron.estimate.memory_model import root_params_per_rank

    r, name = rows[f"3/{window}"], f"stage 3 (--prefetch {window})"
    pb = 4 if args.precision == "fp32" else 2
    ahead = min(1 if window == "default" else int(window), args.layers - 1)
    units = root_params_per_rank(model_cfg(args)) + (1 + ahead) * block_elements(args)
    unit_mib = units * pb / MiB
    states = (pb + 4 + 12) * r["psi"] / args.ranks / MiB  # parameters, fp32 gradients, K = 12, all / Nd
    # stage 3's gathered buffers are created in forward, so its own "activations" count them; what
    # forward holds besides model states (activations, logits, loss) is measured at stage 2 (same
    # model, same tokens): its forward peak above its resting level (the optimizer step's peak)
    act = rows["2"]["forward"] - rows["2"]["step"] if "2" in rows else r["activations"]
    bound = (states + unit_mib + act) * 1.05
    checks = [("forward peak", r["forward"] <= bound,
               f"{name} forward peak {r['forward']:.1f} MiB <= (({pb} + 4 + 12) Psi/Nd "
               f"{states:.1f} + root, running block and {ahead} ahead {unit_mib:.1f} + forward's "
               f"working set {act:.1f}) x 1.05 = {bound:.1f}"),
              ("construction peak", r["construction"] <= r["step_peak"],
               f"{name} construction peak {r['construction']:.1f} <= step peak "
               f"{r['step_peak']:.1f}")]
    if "2" in rows:
        want = 0.6 * (1 - 1 / args.ranks) * pb * r["psi"] / MiB
        saved = rows["2"]["rss"] - r["rss"]
        checks.append(("peak RSS", saved >= want,
                       f"{name} peak RSS {r['rss']:.0f} MiB, {saved:.0f} below stage 2's "
                       f"{rows['2']['rss']:.0f} "
                       f"(at least 60% of (1 - 1/Nd) x {pb} Psi = {want:.0f})"))
    for _, ok, line in checks:
        print(f"{line}: {'yes' if ok else 'NO'}")
    return [f"{name} {check}" for check, ok, _ in checks if not ok]


if __name__ == "__main__":
    sys.exit(main())
