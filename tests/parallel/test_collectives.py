"""Counted collectives on 4 gloo ranks in fp32, bf16 and fp16.

Reference: every rank regenerates every other rank's input from its seed and computes the
expected result with plain tensor arithmetic; byte counters are checked against the ZeRO §7
rule (all-reduce 2Ψ, reduce-scatter/all-gather/broadcast Ψ, p2p the elements moved).
"""

import pytest
import torch

from tests.harness import spawn
from zerotron.parallel import Grid, ParallelDims
from zerotron.parallel import collectives as C
from zerotron.parallel import p2p

WORLD = 4
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def inputs(rank, n, dtype):
    g = torch.Generator().manual_seed(1000 + rank)
    # small integers are exact in every dtype, so sums are exact too
    return torch.randint(-8, 8, (n,), generator=g).to(dtype)


def check_collectives(dtype_name):
    import torch.distributed as dist

    dtype = getattr(torch, dtype_name)
    rank = dist.get_rank()
    grid = Grid(ParallelDims(1, 1))
    world = grid.world_group
    esize = torch.tensor([], dtype=dtype).element_size()
    n = 12
    every = [inputs(r, n, dtype) for r in range(WORLD)]
    mine = every[rank]

    for op, ref in (("sum", sum(x.float() for x in every)),
                    ("max", torch.stack(every).float().amax(0)),
                    ("min", torch.stack(every).float().amin(0)),
                    ("avg", sum(x.float() for x in every) / WORLD)):
        x = mine.clone()
        C.all_reduce(x, world, op=op)
        torch.testing.assert_close(x.float(), ref.to(dtype).float(), msg=f"all_reduce {op}")
        h = C.all_reduce(mine.clone(), world, op=op, async_op=True)
        torch.testing.assert_close(h.wait().float(), ref.to(dtype).float(), msg=f"async all_reduce {op}")

    full = sum(x.float() for x in every).to(dtype)
    out = torch.empty(n // WORLD, dtype=dtype)
    C.reduce_scatter(out, mine.clone(), world)
    assert torch.equal(out, full.chunk(WORLD)[rank])
    out2 = torch.empty(n // WORLD, dtype=dtype)
    C.reduce_scatter(out2, mine.clone(), world, async_op=True).wait()
    assert torch.equal(out2, out)

    gathered = torch.empty(n * WORLD, dtype=dtype)
    C.all_gather(gathered, mine, world)
    assert torch.equal(gathered, torch.cat(every))
    gathered2 = torch.empty(n * WORLD, dtype=dtype)
    C.all_gather(gathered2, mine, world, async_op=True).wait()
    assert torch.equal(gathered2, gathered)

    uneven = [every[r][: r + 1] for r in range(WORLD)]  # sizes 1, 2, 3, 4
    assert torch.equal(C.all_gather_uneven(uneven[rank], world), torch.cat(uneven))
    got = C.all_gather_uneven(uneven[rank], world, sizes=[1, 2, 3, 4], async_op=True).wait()
    assert torch.equal(got, torch.cat(uneven))

    b = mine.clone()
    C.broadcast(b, src=2, group=world)
    assert torch.equal(b, every[2])

    nxt, prv = (rank + 1) % WORLD, (rank - 1) % WORLD
    recv = torch.empty(n, dtype=dtype)
    p2p.batch([p2p.P2POp("send", mine, nxt), p2p.P2POp("recv", recv, prv)], world).wait()
    assert torch.equal(recv, every[prv])
    if rank % 2 == 0:
        p2p.send(mine, nxt, world)
    else:
        assert torch.equal(p2p.recv(torch.empty(n, dtype=dtype), prv, world), every[prv])

    s = grid.stats
    counts = {
        ("all_reduce", 8, 2 * n),             # 4 ops x (sync + async), 2Ψ each
        ("reduce_scatter", 2, n),
        ("broadcast", 1, n),
    }
    for op, calls, per_call in counts:
        got = s.get(op, "world")
        assert got.calls == calls, (op, got)
        if per_call is not None:
            assert got.elements == calls * per_call and got.bytes == calls * per_call * esize, (op, got)
    # all_gather: 2 even gathers of n*WORLD, one size exchange (int64, WORLD) and 2 padded gathers of 4*WORLD
    ag = s.get("all_gather", "world")
    assert ag.calls == 5 and ag.elements == 2 * n * WORLD + WORLD + 2 * 4 * WORLD
    assert ag.bytes == 2 * n * WORLD * esize + WORLD * 8 + 2 * 4 * WORLD * esize
    sent = n * (1 + (rank % 2 == 0))
    assert s.get("send", "world").elements == sent and s.get("send", "world").bytes == sent * esize
    assert s.get("recv", "world").elements == n * (1 + (rank % 2 == 1))
    mark = s.snapshot()
    C.broadcast(b, src=0, group=world)
    window = s.since(mark)  # only what ran after the mark; the running totals are untouched
    assert window.snapshot() == {"broadcast/world": {"calls": 1, "elements": n, "bytes": n * esize}}
    assert s.get("broadcast", "world").calls == 2
    s.reset()
    assert s.snapshot() == {}
    return True


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float16"])
def test_collectives_equal_reference_and_counts(dtype_name):
    assert all(spawn(check_collectives, WORLD, dtype_name, timeout=60))


def check_integer_avg_and_single_rank_groups():
    import torch.distributed as dist

    rank = dist.get_rank()
    grid = Grid(ParallelDims(tp=WORLD))  # dp groups have one member each
    x = torch.tensor([rank * 3 + 1, -rank * 5], dtype=torch.int64)
    C.all_reduce(x, grid.world_group, op="avg")
    ref = torch.tensor([sum(r * 3 + 1 for r in range(WORLD)), -sum(r * 5 for r in range(WORLD))])
    assert torch.equal(x, torch.div(ref, WORLD, rounding_mode="trunc")), x
    y = torch.ones(5)
    C.all_reduce(y, grid.dp_group)  # size-1 group: no call, no count
    assert torch.equal(y, torch.ones(5)) and grid.stats.get("all_reduce", "dp").calls == 0
    return True


def test_integer_avg_and_single_member_groups():
    assert all(spawn(check_integer_avg_and_single_rank_groups, WORLD, timeout=30))


def check_waited_outputs_are_freed():
    import gc
    import time
    import weakref

    grid = Grid(ParallelDims())
    freed = []
    for op in ("all_gather", "all_reduce", "reduce_scatter"):
        src = torch.ones(64)
        if op == "all_gather":
            out = torch.empty(64 * WORLD)
            handle = C.all_gather(out, src, grid.world_group, async_op=True)
        elif op == "all_reduce":
            out = src
            handle = C.all_reduce(out, grid.world_group, async_op=True)
        else:
            out = torch.empty(64 // WORLD)
            handle = C.reduce_scatter(out, src, grid.world_group, async_op=True)
        handle.wait()
        ref = weakref.ref(out.untyped_storage())
        del out, src, handle
        # gloo's worker thread drops its own reference to the Work just after completing it, so a
        # loaded machine may need a moment; a Work kept by zerotron would never let go
        deadline = time.monotonic() + 5.0
        while ref() is not None and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.01)
        freed.append((op, ref() is None))
    return freed


def test_a_waited_collective_lets_its_tensors_go():
    """The health watchdog follows an async collective until it completes; once the caller has
    waited, it must not keep the Work -- a torch Work holds its tensors (stage 3's prefetched
    parameters would otherwise outlive their release until the next prune)."""
    for freed in spawn(check_waited_outputs_are_freed, WORLD, timeout=60):
        assert all(ok for _, ok in freed), freed
