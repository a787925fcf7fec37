"""Smoke check of the process-group grid: every rank prints its coordinates and groups.

    torchrun --standalone --nproc_per_node 4 scripts/checks/smoke_grid.py --tp 2
"""

import argparse

import torch

from zerotron.parallel import Grid, ParallelDims, init_distributed, shutdown
from zerotron.parallel import collectives as C


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    args = parser.parse_args()
    env = init_distributed(timeout_s=60)
    grid = Grid(ParallelDims(args.tp, args.pp))
    x = torch.ones(1, device=env.device)
    C.all_reduce(x, grid.world_group)
    assert int(x.item()) == env.world_size
    print(f"{grid} tp={grid.tp_group.ranks} dp={grid.dp_group.ranks} pp={grid.pp_group.ranks} "
          f"backend={env.backend} comm={grid.stats.snapshot()}", flush=True)
    shutdown()


if __name__ == "__main__":
    main()
