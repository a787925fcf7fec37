"""Measured pipeline bubble per stage against theory, (pp-1)/(m+pp-1) (GPipe §2.2, Megatron-LM §2.2).

    python scripts/bench/pipeline.py --pp 4 --micro 4 8 16

Forks ``pp`` gloo ranks on CPU. Each stage is a stack of layers whose compute is an artificial
cost -- a sleep of ``--forward-ms`` per layer forward and twice that backward -- so the numbers
mean something on a small CPU machine where real kernels of several ranks would fight for the
cores (a sleep holds no core). Activations are tiny, so p2p time is negligible and the idle
fraction of a stage, ``1 - compute / step time``, should approach the theoretical bubble for
both schedules (1F1B has the same bubble as AFAB; it saves activation memory, not time).
"""

from __future__ import annotations

import argparse
import time

from zerotron.testing.launch import spawn

HIDDEN, SEQ, BATCH, VOCAB = 8, 4, 2, 16


def make_stage(grid, layers: int, forward_s: float):
    import torch
    from torch import nn

    class Cost(torch.autograd.Function):
        """Identity whose forward takes ``forward_s`` and backward ``2 * forward_s``."""

        @staticmethod
        def forward(ctx, x):
            time.sleep(forward_s)
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            time.sleep(2 * forward_s)
            return grad

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, HIDDEN) if grid.is_first_stage else None
            self.layers = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(layers))
            self.head = nn.Linear(HIDDEN, VOCAB) if grid.is_last_stage else None

        def forward(self, x, labels=None):
            x = self.embed(x) if self.embed is not None else x
            for layer in self.layers:
                x = Cost.apply(layer(x))
            if self.head is None:
                return x
            return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())

    return Stage()


def worker(args) -> list:
    import torch

    from zerotron.parallel import Grid, ParallelDims
    from zerotron.parallel import collectives as C
    from zerotron.parallel.pipeline import train_step

    grid = Grid(ParallelDims(tp=1, pp=args.pp))
    stage = make_stage(grid, args.layers_per_stage, args.forward_ms / 1000)
    g = torch.Generator().manual_seed(0)
    rows = []
    for schedule in ("afab", "1f1b"):
        for m in args.micro:
            mbs = [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
                    torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)) for _ in range(m)]
            idle, wall = [], []
            for step in range(args.steps + 1):  # step 0 warms up
                C.barrier(grid.world_group)
                out = train_step(stage, mbs, grid, (BATCH, SEQ, HIDDEN), schedule=schedule)
                stage.zero_grad(set_to_none=True)
                if step:
                    idle.append(1 - out.compute_s / out.wall_s)
                    wall.append(out.wall_s)
            rows.append((schedule, m, sum(idle) / len(idle), sum(wall) / len(wall)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--micro", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--forward-ms", type=float, default=10.0, help="artificial forward cost per layer")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.pp < 2 or min(args.micro) < 1:
        parser.error("--pp must be >= 2 and every --micro >= 1")
    results = dict(enumerate(spawn(worker, args.pp, args, timeout=600, store_dir="runs/bench")))
    per_mb = args.layers_per_stage * 3 * args.forward_ms  # forward + backward of one micro-batch, ms
    print(f"pp={args.pp}, {args.layers_per_stage} layers/stage, {args.forward_ms} ms fwd + "
          f"{2 * args.forward_ms} ms bwd per layer (artificial cost), {args.steps} timed steps")
    print(f"{'schedule':8} {'m':>3} {'theory':>7} " + " ".join(f"{'stage' + str(r):>7}" for r in range(args.pp))
          + f" {'mean':>7} {'step ms':>8} {'ideal ms':>8}")
    for i, (schedule, m, _, _) in enumerate(results[0]):
        theory = (args.pp - 1) / (m + args.pp - 1)
        idle = [results[r][i][2] for r in range(args.pp)]
        wall = max(results[r][i][3] for r in range(args.pp)) * 1000
        print(f"{schedule:8} {m:>3} {theory:7.3f} " + " ".join(f"{x:7.3f}" for x in idle)
              + f" {sum(idle) / len(idle):7.3f} {wall:8.1f} {(m + args.pp - 1) * per_mb:8.1f}")


if __name__ == "__main__":
    main()
