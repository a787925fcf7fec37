"""No silent hangs: a diverging, dead or stuck rank is named by the others, within the timeout."""

import os
import re
import time

import pytest
import torch

from tests.harness import spawn
from zerotron.parallel import Grid, ParallelDims
from zerotron.parallel import collectives as C
from zerotron.parallel import p2p
from zerotron.parallel.health import CollectiveError, Health
from zerotron.testing.drill_run import NAMED


def diverging_shapes():
    import torch.distributed as dist

    grid = Grid(ParallelDims())
    grid.health.check_sequence = True
    C.all_reduce(torch.ones(4), grid.world_group)  # identical on every rank: passes the check
    n = 5 if dist.get_rank() == 1 else 4
    try:
        C.all_reduce(torch.ones(n), grid.world_group)
    except CollectiveError as e:
        return str(e)
    return "no error"


def test_debug_mode_reports_the_first_divergence_with_both_call_sites():
    msgs = spawn(diverging_shapes, 3, timeout=60)
    for rank, msg in enumerate(msgs):
        assert "collectives diverged on group world at its collective #2" in msg, msg
        assert "test_health.py" in msg and "diverging_shapes" in msg
    assert "rank 0 calls all_reduce|world|(4,)|float32" in msgs[0] and "rank 1 calls all_reduce|world|(5,)" in msgs[0]


def test_the_call_site_is_walked_for_in_debug_mode_only(monkeypatch):
    import types

    from zerotron.parallel import health

    walks = []
    monkeypatch.setattr(health, "call_site", lambda: walks.append(1) or "model.py:7 in forward")
    group = types.SimpleNamespace(name="tp", ranks=[0], size=1)
    for debug in (False, True):
        h = Health(0, 1, check_sequence=debug)
        h.before("all_reduce", group, torch.ones(3))
        h.issued()
        assert len(walks) == int(debug) and h.last.endswith("model.py:7 in forward") == debug, h.last
        assert h.last.startswith("all_reduce on tp #1 shape=(3,) dtype=float32")


def one_rank_stuck():
    import torch.distributed as dist

    grid = Grid(ParallelDims())
    C.all_reduce(torch.ones(1), grid.world_group)
    if dist.get_rank() == 0:
        time.sleep(9)  # alive (its heartbeat thread runs) but never reaches the next collective in time
        return "slept"
    start = time.monotonic()
    try:
        C.all_reduce(torch.ones(1), grid.world_group)
    except CollectiveError as e:
        return f"{time.monotonic() - start:.1f}s {e}"
    return "no error"


def test_stuck_rank_is_named_within_the_timeout():
    msgs = spawn(one_rank_stuck, 3, timeout=60, collective_timeout=3, may_die=(0,))  # not waited for once named
    for msg in msgs[1:]:
        assert "rank 0 is alive but stuck behind" in msg, msg
        assert float(msg.split("s ")[0]) < 9


def one_rank_dies():
    import torch.distributed as dist

    grid = Grid(ParallelDims())
    C.all_reduce(torch.ones(1), grid.world_group)
    time.sleep(1.5)  # let every heartbeat be published once
    if dist.get_rank() == 2:
        os._exit(7)
    try:
        C.all_reduce(torch.ones(1), grid.world_group)
        C.all_reduce(torch.ones(1), grid.world_group)
    except CollectiveError as e:
        return str(e)
    return "no error"


def test_dead_rank_is_named():
    msgs = spawn(one_rank_dies, 3, timeout=60, collective_timeout=5, may_die=(2,))
    assert msgs[2] is None
    for msg in msgs[:2]:
        assert "rank 2 is dead or frozen (its heartbeat stopped" in msg, msg


def test_health_without_a_store_still_counts():
    h = Health(rank=0, world_size=1)
    assert h._thread is None


def one_rank_dies_between_heartbeats():
    import torch.distributed as dist

    grid = Grid(ParallelDims())
    if dist.get_rank() == 1:  # its last beat is the one published at start-up, however slow the machine
        grid.health._stop.set()
        for t in grid.health._threads:
            t.join()
    for _ in range(3):  # issued after that beat, which so shows none of them
        C.all_reduce(torch.ones(1), grid.world_group)
    if dist.get_rank() == 1:
        os._exit(7)
    try:
        C.all_reduce(torch.ones(1), grid.world_group)
    except CollectiveError as e:
        return str(e)
    return "no error"


def test_a_dead_ranks_last_heartbeat_is_reported_as_of_its_time():
    """A heartbeat is up to ``heartbeat_s`` old when its rank dies: what it shows is where the rank
    was then, not its last collective -- this one had issued three, its only beat showed none."""
    msgs = spawn(one_rank_dies_between_heartbeats, 2, timeout=60, collective_timeout=5, may_die=(1,))
    msg = msgs[0]
    assert "rank 1 is dead or frozen (its heartbeat stopped" in msg, msg
    assert "last: no collective yet" not in msg, msg
    assert re.search(r"the last one, at \d\d:\d\d:\d\d\.\d UTC, had it before its first collective\)", msg), msg


def waits_on_a_dead_peer(kind):
    import torch.distributed as dist

    from zerotron.parallel import p2p

    grid = Grid(ParallelDims())
    g = grid.world_group
    for _ in range(3):  # transfers world:0-1 #1..#6, then collective world #1 below
        p2p.batch([p2p.P2POp("send", torch.ones(2), 1 - dist.get_rank()),
                   p2p.P2POp("recv", torch.empty(2), 1 - dist.get_rank())], g).wait()
    C.all_reduce(torch.ones(1), g)
    time.sleep(1.5)  # every heartbeat published after the warm-up
    if dist.get_rank() == 1:
        os._exit(7)
    try:
        if kind == "p2p":  # transfer #7 fails
            p2p.batch([p2p.P2POp("recv", torch.empty(2), 1)], g).wait()
        else:  # collectives #2 and #3 in flight; #2 is waited for and fails
            first = C.all_reduce(torch.ones(1), g, async_op=True)
            C.all_reduce(torch.ones(1), g, async_op=True)
            first.wait()
    except CollectiveError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("kind, where", [("p2p", "p2p on group world (transfer world:0-1 #7)"),
                                         ("async", "all_reduce on group world (its collective #2)")])
def test_a_failure_names_the_transfer_or_collective_that_failed(kind, where):
    """The failed op's own sequence number, not the group's latest count: a pipeline's transfers are
    counted per pair of ranks, and an async collective fails at its wait, after later ones were issued."""
    msgs = spawn(waits_on_a_dead_peer, 2, kind, timeout=60, collective_timeout=5, may_die=(1,))
    assert msgs[0].startswith(f"rank 0: {where} at "), msgs[0]
    assert "rank 1 is dead or frozen" in msgs[0], msgs[0]


def test_a_peer_that_has_made_only_part_of_a_p2p_batch_is_followed():
    """Rank 2's last pipeline batch to rank 6 holds transfers #5 and #6; rank 6 has made #5 and waits
    in a DP reduction for rank 4, which is behind. Judged on #5 alone, rank 6 looked caught up and
    nobody was named ("a network fault?"): TP2xPP2xDP2 with one micro-batch, a rank stuck in stage 0."""
    beats = {6: {"counts": {"pp:2-6": 5, "dp": 26}, "inflight": [["dp", [4, 6], 26]], "verdict": None,
                 "last": "reduce_scatter on dp #26"},
             4: {"counts": {"pp:0-4": 5, "dp": 25}, "inflight": [], "verdict": None, "last": "recv on pp:0-4 #6"}}
    clock = iter(range(100))
    h = Health(rank=2, world_size=1, heartbeat_s=0.0)
    h._read = lambda m: {**beats[m], "t": float(next(clock))}  # alive: a newer time at every read
    found = h._blame([("pp:2-6", (2, 6), 5), ("pp:2-6", (2, 6), 6)])
    assert found == [(4, "rank 6 is behind on pp:2-6, waiting for: rank 4 is alive but stuck behind: it is at recv on pp:0-4 #6")]


def fault_under_nccl_semantics(tp: int, pp: int, sig: int, cp: int = 1):
    """Rank 1 is killed or frozen mid-run; no collective raises (``ZEROTRON_EMULATE_NCCL``)."""
    import signal as signals

    import torch.distributed as dist

    os.environ["ZEROTRON_EMULATE_NCCL"] = "1"
    grid = Grid(ParallelDims(tp=tp, cp=cp, pp=pp))
    C.all_reduce(torch.ones(1), grid.world_group)
    time.sleep(1.5)  # let every heartbeat be published once
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signals.Signals(sig))
    other = grid.pp_group if pp > 1 else grid.dp_group
    n = grid.cp_size  # CP: the ring's exchange, to the next CP rank and from the previous
    ring = [p2p.P2POp("send", torch.ones(1), grid.cp_group.ranks[(grid.cp_rank + 1) % n]),
            p2p.P2POp("recv", torch.empty(1), grid.cp_group.ranks[(grid.cp_rank - 1) % n])]
    for _ in range(3):  # rank 0 waits for rank 1 on TP; ranks 2 and 3 for rank 0 on DP, PP or CP
        C.all_reduce(torch.ones(1), grid.tp_group)
        if n > 1:
            p2p.batch(ring, grid.cp_group).wait()
        else:
            C.all_reduce(torch.ones(1), other)
    return "no error"


@pytest.mark.parametrize("tp,pp,sig,cp", [(2, 1, 9, 1), (2, 2, 19, 1), (2, 1, 19, 2)],
                         ids=["tp2xdp2-kill9", "tp2xpp2-sigstop", "tp2xcp2-sigstop"])
def test_under_nccl_semantics_the_watchdog_names_the_culprit_and_exits_3(tp, pp, sig, cp, capfd):
    """NCCL's ``wait()`` never raises on a dead or frozen peer: every survivor's own watchdog must
    name rank 1 and end the process with exit 3, within the collective timeout + 10 s."""
    from zerotron.testing.launch import Ranks

    timeout = 6.0
    with Ranks(fault_under_nccl_semantics, 4, tp, pp, sig, cp, collective_timeout=timeout,
               may_die=(0, 1, 2, 3)) as job:
        start, bound = time.monotonic(), 1.5 + timeout + 10
        survivors = [job.procs[r] for r in (0, 2, 3)]
        while any(p.is_alive() for p in survivors) and time.monotonic() - start < bound + 20:
            time.sleep(0.2)
        took = time.monotonic() - start
        codes = [p.exitcode for p in survivors]
    err = capfd.readouterr().err
    named = re.findall(r"^\[rank (\d+)\] CollectiveError: .*", err, flags=re.M)
    assert codes == [3, 3, 3], (codes, err[-3000:])
    assert sorted(named) == ["0", "2", "3"], err[-3000:]
    for line in re.findall(r"^\[rank \d+\] CollectiveError: .*", err, flags=re.M):
        assert set(re.findall(NAMED, line)) == {"1"}, line  # as the drills read it: rank 1 alone
    assert took < bound, took


def dead_peer_then_sigterm():
    """Rank 1 is killed; the others block in a TP/DP all-reduce under NCCL semantics, with the
    SIGTERM handler a trainer installs (its flag is never read: the main thread is blocked)."""
    import signal as signals

    import torch.distributed as dist

    os.environ["ZEROTRON_EMULATE_NCCL"] = "1"
    signals.signal(signals.SIGTERM, lambda *_: None)
    grid = Grid(ParallelDims(tp=2))
    C.all_reduce(torch.ones(1), grid.world_group)
    time.sleep(1.5)  # let every heartbeat be published once
    if dist.get_rank() == 1:
        os._exit(9)
    for _ in range(3):
        C.all_reduce(torch.ones(1), grid.tp_group)
        C.all_reduce(torch.ones(1), grid.dp_group)
    return "no error"


def test_a_sigterm_while_waiting_on_a_dead_rank_names_it_at_once(capfd):
    """torchrun SIGTERMs the survivors of a dead rank and SIGKILLs them 30 s later; under NCCL the
    blocked main thread never runs its handler, and the watchdog would wait for the timeout (60 s
    here). The signal reaches the watchdog through the wakeup descriptor: every survivor names
    rank 1 and exits 3 within seconds of the SIGTERM. (Mutation: no wakeup -> killed nameless.)"""
    import signal as signals

    from zerotron.testing.launch import Ranks

    with Ranks(dead_peer_then_sigterm, 4, collective_timeout=60.0, may_die=(0, 1, 2, 3)) as job:
        job.procs[1].join(timeout=60)  # at once, as torchrun: rank 1's heartbeat is not stale yet
        survivors = [job.procs[r] for r in (0, 2, 3)]
        start = time.monotonic()
        for p in survivors:
            os.kill(p.pid, signals.SIGTERM)
        for p in survivors:  # the watchdog's own verdict would come only at 60 s - 10 s
            p.join(timeout=max(1.0, start + 25 - time.monotonic()))
        codes = [p.exitcode for p in survivors]
    err = capfd.readouterr().err
    assert codes == [3, 3, 3], (codes, err[-3000:])
    lines = re.findall(r"^\[rank \d+\] CollectiveError: .*being stopped \(SIGTERM\).*", err, flags=re.M)
    assert len(lines) == 3 and all(set(re.findall(NAMED, line)) == {"1"} for line in lines), err[-3000:]


def test_many_ops_in_flight_are_pruned_in_amortized_constant_time():
    """A pipeline keeps hundreds of async transfers in flight: pruning on every launch past 256
    rescanned them all each time (quadratic); now it waits until the list has doubled."""
    import types

    polls = []

    class Pending:  # a torch Work that never completes
        def is_completed(self):
            polls.append(1)
            return False

    h, group = Health(0, 1), types.SimpleNamespace(name="pp", ranks=[0, 1], size=2)
    n = 3000
    for _ in range(n):
        h.before("send", group, torch.ones(1), peer=1)
        h.issued(Pending())
    assert len(h._inflight) == n
    assert len(polls) < 4 * n, len(polls)  # was ~n^2/2 = 4.5 million polls
