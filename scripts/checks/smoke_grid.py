"""Smoke check of the process-group grid: every rank prints its coordinates and groups.

    torchrun --standalone --nproc_per_node 4 scripts/checks/smoke_grid.py --tp 2

The layout is checked against ``WORLD_SIZE`` (``ParallelDims.resolve``, what the grid itself
checks) before ``init_distributed``: a bad --tp/--pp exits 2 on every rank with one message,
before any rank waits in a rendezvous for the others.
"""

import argparse
import os

import torch

from zerotron.parallel import Grid, ParallelDims, init_distributed, shutdown
from zerotron.parallel import collectives as C
from zerotron.testing.bench_args import flag_errors, positive_int


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel size")
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    note = f"WORLD_SIZE={world}: the processes the launcher started"
    with flag_errors(parser, {"tp": "--tp", "pp": "--pp"}, note=note):
        ParallelDims(args.tp, args.pp).resolve(world)
    env = init_distributed(timeout_s=60)
    grid = Grid(ParallelDims(args.tp, args.pp))
    x = torch.ones(1, device=env.device)
    C.all_reduce(x, grid.world_group)
    if int(x.item()) != env.world_size:
        raise SystemExit(f"all-reduce of ones over the world gave {int(x.item())}, not {env.world_size}")
    print(f"{grid} tp={grid.tp_group.ranks} dp={grid.dp_group.ranks} pp={grid.pp_group.ranks} "
          f"backend={env.backend} comm={grid.stats.snapshot()}", flush=True)
    shutdown()


if __name__ == "__main__":
    main()
