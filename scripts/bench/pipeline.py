"""Pipeline schedules measured against their formulas: the bubble and the peak activation memory
of every stage, for AFAB, 1F1B and interleaved 1F1B (v = 2, 4), and what freeing sent outputs saves.

    python scripts/bench/pipeline.py --pp 4 --micro 4 8 16 --virtual 1 2 4

Forks ``pp`` gloo ranks on CPU. Each rank holds ``--layers-per-stage`` layers (a linear layer
followed by an artificial cost: a sleep of ``--forward-ms`` per layer forward and twice that
backward), as ``v`` model chunks of ``layers / v`` layers; a sleep holds no core, so the numbers
mean something on a small CPU machine where the real kernels of several ranks would fight for
the cores. Activations are small, so p2p time is negligible and a stage's measured idle
fraction, ``1 - compute / step time``, should approach (p-1)/(v·m+p-1) (AFAB and 1F1B: v = 1).

Memory: ``MemoryTracker`` (allocator-side: every storage alive) runs through the step, each
forward and backward in its phase; a stage's peak *activations* (storages made by forwards and
still alive) is reported in units of one layer's saved input, A = b·s·h·4 bytes. The formula:
every chunk-forward in flight (``microbatches_in_flight``) keeps one input per layer of the
chunk, (layers / v) A. At the peak a stage also holds the output it is computing and one layer's
matmul result before its copy (+2 A), and the last rank the loss's input of each forward of its
last chunk in flight. A stage's output is not saved by autograd: it is held only until it is
sent, then freed (``parallel.pipeline``). The last table runs 1F1B with outputs kept and freed:
the peak drops by every output already sent at that moment -- all in flight but the one being
computed.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from zerotron.testing.bench_args import positive_float, positive_int
from zerotron.testing.launch import spawn

ROOT = Path(__file__).resolve().parents[2]
STORE = str(ROOT / "runs" / "bench")  # the ranks' rendezvous files: under the checkout, whatever the cwd

HIDDEN, SEQ, BATCH, VOCAB = 64, 16, 4, 64
A_BYTES = BATCH * SEQ * HIDDEN * 4  # one layer's saved input (fp32)


def make_chunks(grid, layers: int, v: int, forward_s: float):
    """This rank's v model chunks: linear + cost layers, the embedding on virtual stage 0 and a
    loss (mean square of the hidden state) on the last."""
    import torch
    from torch import nn

    class Cost(torch.autograd.Function):
        """Identity (a copy) whose forward takes ``forward_s`` and backward ``2 * forward_s``."""

        @staticmethod
        def forward(ctx, x):
            time.sleep(forward_s)
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            time.sleep(2 * forward_s)
            return grad

    class Chunk(nn.Module):
        def __init__(self, first: bool, last: bool):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, HIDDEN) if first else None
            self.layers = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(layers // v))
            self.last = last

        def forward(self, x, labels=None):
            x = self.embed(x) if self.embed is not None else x
            for layer in self.layers:
                x = Cost.apply(layer(x))
            return x.pow(2).mean() if self.last else x

    p, r = grid.pp_size, grid.pp_rank
    return [Chunk(c == 0 and r == 0, c == v - 1 and r == p - 1) for c in range(v)]


def worker(args) -> list:
    import torch

    from zerotron.parallel import Grid, ParallelDims
    from zerotron.parallel import collectives as C
    from zerotron.parallel.memory_tracker import MemoryTracker
    from zerotron.parallel.pipeline import train_step

    grid = Grid(ParallelDims(tp=1, pp=args.pp))
    g = torch.Generator().manual_seed(0)
    runs = [("afab", 1, True), ("1f1b", 1, True)] + [("1f1b", v, True) for v in args.virtual if v > 1]
    runs += [("1f1b", 1, False)]  # outputs kept: the baseline of the freeing
    rows = []
    for schedule, v, free in runs:
        chunks = make_chunks(grid, args.layers_per_stage, v, args.forward_ms / 1000)
        params = [q for c in chunks for q in c.parameters()]
        for m in args.micro:
            if v > 1 and m % args.pp or (not free and m != max(args.micro)):
                continue
            mbs = [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), None) for _ in range(m)]
            idle, wall, peak = [], [], 0
            for step in range(args.steps + 1):  # step 0 warms up (and is the one measured for memory)
                C.barrier(grid.world_group)
                tracker = MemoryTracker() if step == 0 else None
                if tracker is not None:
                    tracker.register("parameters", params)
                    tracker.register("gradients", [q.grad for q in params])
                    with tracker:
                        train_step(chunks, mbs, grid, (BATCH, SEQ, HIDDEN), schedule=schedule,
                                   free_outputs=free, memory=tracker)
                    peak = tracker.category_peaks["activations"]
                else:
                    out = train_step(chunks, mbs, grid, (BATCH, SEQ, HIDDEN), schedule=schedule, free_outputs=free)
                    idle.append(1 - out.compute_s / out.wall_s)
                    wall.append(out.wall_s)
                for q in params:
                    q.grad = None
            rows.append((schedule, v, free, m, sum(idle) / len(idle), sum(wall) / len(wall), peak))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=positive_int, default=4, help="pipeline stages (gloo ranks), at least 2")
    parser.add_argument("--micro", type=positive_int, nargs="+", default=[4, 8, 16], help="micro-batches per step (m)")
    parser.add_argument("--virtual", type=positive_int, nargs="+", default=[1, 2, 4], help="model chunks per rank (v)")
    parser.add_argument("--layers-per-stage", type=positive_int, default=4, help="a multiple of every --virtual")
    parser.add_argument("--forward-ms", type=positive_float, default=25.0, help="artificial forward cost per layer")
    parser.add_argument("--steps", type=positive_int, default=3, help="timed steps after the warm-up one")
    args = parser.parse_args(argv)
    if args.pp < 2:
        parser.error(f"--pp {args.pp}: a pipeline needs at least 2 stages")
    uneven = [v for v in args.virtual if args.layers_per_stage % v]
    if uneven:
        parser.error(f"--layers-per-stage {args.layers_per_stage} does not split into --virtual {uneven} chunks; "
                     f"use a multiple of every --virtual")
    interleaved = [m for m in args.micro if m % args.pp == 0]
    if any(v > 1 for v in args.virtual) and not interleaved:
        parser.error(f"--virtual above 1 (interleaved 1F1B) needs a --micro that is a multiple of --pp {args.pp}; "
                     f"none of {args.micro} is")
    from zerotron.parallel.pipeline_schedules import bubble_fraction, microbatches_in_flight

    p, layers = args.pp, args.layers_per_stage
    results = spawn(worker, p, args, timeout=1200, store_dir=STORE)
    print(f"pp={p}, {layers} layers/stage, {args.forward_ms} ms fwd + {2 * args.forward_ms} ms bwd per layer "
          f"(artificial cost), {args.steps} timed steps; memory in A = b*s*h*4 = {A_BYTES} B")
    stages = " ".join(f"{'s' + str(r):>6}" for r in range(p))
    print(f"\nbubble (idle fraction per stage)\n{'schedule':10} {'m':>3} {'theory':>6} {stages} {'mean':>6} "
          f"{'step ms':>8} {'ideal ms':>8}")
    for i, (schedule, v, free, m, _, _, _) in enumerate(results[0]):
        if not free:
            continue
        idle = [results[r][i][4] for r in range(p)]
        wall = max(results[r][i][5] for r in range(p)) * 1000
        ideal = (v * m + p - 1) * layers * 3 * args.forward_ms / v
        name = schedule if v == 1 else f"{schedule} v={v}"
        print(f"{name:10} {m:>3} {bubble_fraction(schedule, p, m, v):6.3f} " + " ".join(f"{x:6.3f}" for x in idle)
              + f" {sum(idle) / p:6.3f} {wall:8.1f} {ideal:8.1f}")
    print(f"\npeak activations per stage, measured / formula (in-flight chunk-forwards x layers per chunk), in A\n"
          f"{'schedule':10} {'m':>3} " + " ".join(f"{'s' + str(r):>11}" for r in range(p)))
    for i, (schedule, v, free, m, _, _, _) in enumerate(results[0]):
        if not free:
            continue
        cells = []
        for r in range(p):
            formula = microbatches_in_flight(schedule, p, r, m, v) * layers // v
            cells.append(f"{results[r][i][6] / A_BYTES:5.1f}/{formula:<5d}")
        print(f"{schedule if v == 1 else f'{schedule} v={v}':10} {m:>3} " + " ".join(cells))
    kept = next(i for i, row in enumerate(results[0]) if not row[2])
    m = results[0][kept][3]
    freed = next(i for i, row in enumerate(results[0]) if row[:4] == ("1f1b", 1, True, m))
    print(f"\n1F1B m={m}, outputs kept vs freed after their send (in A)\n{'stage':>5} {'kept':>6} {'freed':>6} "
          f"{'drop':>6} {'in flight':>9} {'sent outputs at peak':>20}")
    for r in range(p):
        a, b = results[r][kept][6] / A_BYTES, results[r][freed][6] / A_BYTES
        n = microbatches_in_flight("1f1b", p, r, m)
        sent = 0 if r == p - 1 else n - 1  # the last stage sends none; the newest is being computed
        print(f"{r:>5} {a:6.1f} {b:6.1f} {a - b:6.1f} {n:>9} {sent:>20}")


if __name__ == "__main__":
    main()
