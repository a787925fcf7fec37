"""A frozen (SIGSTOP) or dead rank is named by every survivor in every layout, within the timeout.

Every TP, CP, DP and PP group carries the collective timeout (not only the world group), so the
survivors fail instead of waiting torch's default 30 minutes; each then names the same rank,
including survivors that only wait for it through a third rank (a DP peer stuck in its TP
all-reduce). The step below has the traffic of a real one: the CP ring's exchange, a TP
all-reduce per stage, the activation and gradient exchanged between pipeline stages, a DP
all-reduce of the gradients.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest
import torch

from tests.harness import Ranks, spawn
from zerotron.parallel import Grid, ParallelDims
from zerotron.parallel import collectives as C
from zerotron.parallel import p2p

TIMEOUT_S = 8.0
UNFREEZE_S = TIMEOUT_S + 8  # the frozen rank thaws and exits after this: the survivors must have named it


def fake_step(grid: Grid) -> None:
    x = torch.ones(8)
    if grid.cp_size > 1:  # ring attention's K/V exchange: to the next CP rank, from the previous
        cp, n = grid.cp_group, grid.cp_size
        ring = [p2p.P2POp("send", x, cp.ranks[(grid.cp_rank + 1) % n]),
                p2p.P2POp("recv", torch.empty_like(x), cp.ranks[(grid.cp_rank - 1) % n])]
        p2p.batch(ring, cp).wait()
    pp = grid.pp_group
    if not grid.is_first_stage:  # forward: activation from the previous stage
        p2p.batch([p2p.P2POp("recv", x, grid.prev_pp_rank)], pp).wait()
    C.all_reduce(x, grid.tp_group)
    if not grid.is_last_stage:
        p2p.batch([p2p.P2POp("send", x, grid.next_pp_rank)], pp).wait()
        p2p.batch([p2p.P2POp("recv", x, grid.next_pp_rank)], pp).wait()  # backward: its gradient
    C.all_reduce(x, grid.tp_group)
    if not grid.is_first_stage:
        p2p.batch([p2p.P2POp("send", x, grid.prev_pp_rank)], pp).wait()
    C.all_reduce(x, grid.dp_group)


def drill(tp: int, cp: int, pp: int, culprit: int, fault: str):
    import torch.distributed as dist

    from zerotron.parallel.health import CollectiveError

    grid = Grid(ParallelDims(tp=tp, cp=cp, pp=pp))
    assert grid.timeout.total_seconds() == TIMEOUT_S
    for _ in range(2):
        fake_step(grid)
    C.barrier(grid.world_group)
    start = time.monotonic()
    if dist.get_rank() == culprit:
        if fault == "freeze":  # heartbeat thread frozen too; thawed later, it then exits like a dead one
            subprocess.Popen(["sh", "-c", f"sleep {UNFREEZE_S}; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(9)
    try:
        for _ in range(3):
            fake_step(grid)
    except CollectiveError as e:
        return time.monotonic() - start, str(e), fault, grid.tp_size, grid.cp_size, grid.pp_size
    return time.monotonic() - start, "no error", fault, grid.tp_size, grid.cp_size, grid.pp_size


# TP 2 x CP 2: rank 0 waits for rank 1 on TP, rank 3 in the CP ring, rank 2 in the ring on rank 0
@pytest.mark.parametrize("tp,cp,pp,world,culprit",
                         [(2, 1, 1, 4, 1), (2, 1, 2, 4, 1), (2, 1, 2, 8, 5), (2, 2, 1, 4, 1)],
                         ids=["tp2xdp2", "tp2xpp2", "tp2xpp2xdp2", "tp2xcp2"])
@pytest.mark.parametrize("fault", ["freeze", "dead"])
def test_every_survivor_names_the_culprit(tp, cp, pp, world, culprit, fault, overlap, request):
    def start(p):
        return Ranks(drill, p["world"], p["tp"], p["cp"], p["pp"], p["culprit"], p["fault"],
                     collective_timeout=TIMEOUT_S, may_die=(p["culprit"],))

    with overlap.ranks(request, start) as ranks:  # the next layout's drill waits out its timeout meanwhile
        res = ranks.wait(timeout=UNFREEZE_S + 60)
    assert res[culprit] is None
    for rank, answer in enumerate(res):
        if rank == culprit:
            continue
        seconds, msg, *ran = answer
        assert ran == [fault, tp, cp, pp], f"rank {rank} ran another case's drill: {ran}"  # Overlap's bookkeeping
        blamed = set(re.findall(r"rank (\d+) (?:is dead or frozen|is alive but stuck|has no readable)", msg))
        assert blamed == {str(culprit)}, f"rank {rank}: {msg}"
        assert f"rank {culprit} is dead or frozen" in msg, f"rank {rank}: {msg}"
        assert seconds < TIMEOUT_S + 10, f"rank {rank} took {seconds:.1f}s: {msg}"
        print(f"{fault} tp={tp} cp={cp} pp={pp} world={world}: rank {rank} named rank {culprit} "
              f"after {seconds:.1f}s")


def watchdog_without_an_error(timeout_s: float):
    """NCCL's case: the op never raises (its watchdog would abort the process at the timeout), so
    the diagnosis must come from the health watchdog, in time."""
    import contextlib
    import io
    import types

    import torch.distributed as dist

    from zerotron.parallel.health import Health

    health = Health(dist.get_rank(), 2, timeout_s=timeout_s)
    dist.barrier()
    if dist.get_rank() == 1:  # alive, never joins
        time.sleep(timeout_s + 1)
        return None
    group = types.SimpleNamespace(name="tp", ranks=(0, 1), size=2)
    err, start = io.StringIO(), time.monotonic()
    with contextlib.redirect_stderr(err):
        health.before("all_reduce", group, torch.ones(1))  # in flight, and nothing will complete it
        while "zerotron watchdog" not in err.getvalue() and time.monotonic() - start < timeout_s + 3:
            time.sleep(0.1)
    return time.monotonic() - start, err.getvalue()


def test_watchdog_names_the_culprit_before_the_timeout():
    seconds, err = spawn(watchdog_without_an_error, 2, 6.0, collective_timeout=30, may_die=(1,))[0]  # 1: not waited for
    assert "zerotron watchdog: all_reduce on tp #1" in err and "rank 1 is alive but stuck behind" in err, err
    assert seconds < 6.0, f"named after {seconds:.1f}s, after the 6s timeout: {err}"
