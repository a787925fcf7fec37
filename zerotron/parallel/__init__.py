"""Parallel primitives: the process-group grid, counted collectives, p2p, TP layers, PP schedule, RNG.

This package imports nothing from the rest of zerotron.
"""

from zerotron.parallel.comm_stats import CommStats
from zerotron.parallel.grid import Grid, Group, ParallelDims, layout
from zerotron.parallel.runtime import DistEnv, init_distributed, pick_backend, pick_device, shutdown

__all__ = [
    "CommStats", "DistEnv", "Grid", "Group", "ParallelDims", "init_distributed", "layout",
    "pick_backend", "pick_device", "shutdown",
]
