"""The multi-process harness itself: failures are reported with their rank and never hang."""

import os
import time

import pytest
import torch

from tests.harness import RankFailure, Ranks, spawn
from zerotron.parallel import Grid, ParallelDims
from zerotron.parallel import collectives as C


def one_rank_raises():
    import torch.distributed as dist

    if dist.get_rank() == 2:
        raise RuntimeError("boom on purpose")
    time.sleep(600)  # never finishes (a collective would: health names the dead rank 2 in seconds)
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
    """Quickly: at the raise, not after the peers, which never finish; the report must come while
    they are still running -- held by that mechanism, not by a wall clock, which the start-up of
    4 ranks on a loaded machine could exceed. A launcher that waited for them would time out."""
    with Ranks(one_rank_raises, 4) as ranks:
        with pytest.raises(RankFailure) as info:
            ranks.wait(timeout=120)
        waiting = [r for r in (0, 1, 3) if ranks.procs[r].is_alive()]
    text = str(info.value)
    assert text.startswith("1 rank(s) failed: [2]") and "timed out" not in text, text
    assert waiting == [0, 1, 3], f"the report waited for the peers of the raising rank: {waiting}"
    assert "rank 2 failed" in text and "boom on purpose" in text and "one_rank_raises" in text


def test_a_dead_rank_is_reported():
    with pytest.raises(RankFailure, match=r"rank 1 (died|exited)"):
        spawn(one_rank_dies, 4)  # no deadline of its own: what is held is the naming


def test_a_hung_rank_times_out_and_is_named():
    """Rank 1 answers, rank 0 never does: the 3 s deadline names rank 0 alone, and ``wait`` keeps
    it. The clock starts once rank 1 has answered, so a slow start-up on a loaded machine can
    neither name rank 1 too nor be counted against the deadline."""
    with Ranks(one_rank_hangs, 2) as ranks:
        assert ranks.conns[1].poll(120), "rank 1 never answered"  # read by wait() below
        start = time.monotonic()
        with pytest.raises(RankFailure, match=r"timed out after 3s; rank\(s\) \[0\] never") as info:
            ranks.wait(timeout=3)
        waited = time.monotonic() - start
    assert 3 <= waited < 15, waited
    stack = str(info.value).split("--- rank 0 was still running, at ---")[-1]  # where it hangs
    assert "in one_rank_hangs" in stack and "rank 1 was still" not in str(info.value), info.value


def test_results_come_back_in_rank_order():
    assert spawn(_rank, 3) == [0, 1, 2]


def _rank():
    import torch.distributed as dist

    return dist.get_rank()
