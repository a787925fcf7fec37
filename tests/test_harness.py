"""The multi-process harness itself: failures are reported with their rank and never hang."""

import os
import time

import pytest
import torch

from tests.harness import RankFailure, spawn
from zerotron.parallel import Grid, ParallelDims
from zerotron.parallel import collectives as C


def one_rank_raises():
    import torch.distributed as dist

    grid = Grid(ParallelDims())
    if dist.get_rank() == 2:
        raise RuntimeError("boom on purpose")
    C.all_reduce(torch.ones(1), grid.world_group)  # the others wait for rank 2 forever
    return True


def one_rank_dies():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(3)
    C.all_reduce(torch.ones(1), Grid(ParallelDims()).world_group)


def one_rank_hangs():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        time.sleep(600)
    return True


def test_a_raising_rank_is_reported_with_its_traceback_quickly():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        spawn(one_rank_raises, 4, timeout=30)
    assert time.monotonic() - start < 20
    text = str(info.value)
    assert "rank 2 failed" in text and "boom on purpose" in text and "one_rank_raises" in text


def test_a_dead_rank_is_reported():
    with pytest.raises(RankFailure, match=r"rank 1 (died|exited)"):
        spawn(one_rank_dies, 4, timeout=30)


def test_a_hung_rank_times_out_and_is_named():
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"timed out after 3s; rank\(s\) \[0\]"):
        spawn(one_rank_hangs, 2, timeout=3)
    assert time.monotonic() - start < 15


def test_results_come_back_in_rank_order():
    assert spawn(_rank, 3) == [0, 1, 2]


def _rank():
    import torch.distributed as dist

    return dist.get_rank()
