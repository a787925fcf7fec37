"""``parallel/agreement.py`` on 3 gloo ranks: rank 0's value or error reaches every rank, and
each rank's report reaches every rank.

Reference: what each rank would have to learn is known to the test without the helper: rank
0's value (a nested JSON value that only rank 0 computes), rank 0's error text, and every
rank's own code (a function of its rank that a peer cannot see unless it is sent).
"""

import torch

from tests.harness import spawn
from zerotron.parallel import Grid, ParallelDims

WORLD = 3


class Refused(RuntimeError):
    """A failure rank 0 meets that every rank must raise."""


def decide_and_report():
    import torch.distributed as dist

    from zerotron.parallel import agreement

    torch.set_num_threads(1)
    rank, grid = dist.get_rank(), Grid(ParallelDims(1, 1))
    device = torch.device("cpu")
    calls = []

    def decide():
        calls.append(rank)  # only rank 0 may act
        return {"note": "taken by rank 0", "pid": [rank, "ü"]}

    got = agreement.rank0_decides(decide, grid, device, failures=(Refused,))

    def refuse():
        raise Refused("the lock is held by host h, pid 7; stop that run")

    try:
        agreement.rank0_decides(refuse, grid, device, failures=(KeyError, Refused))
        refused = None
    except Refused as e:
        refused = str(e)
    empty = agreement.rank0_decides(lambda: "", grid, device)
    codes = agreement.every_rank_reports({rank: [0, 28, -1][rank]}, WORLD, grid, device)
    slots = agreement.every_rank_reports({i: 10 + i for i in range(rank, 7, WORLD)}, 7, grid, device)
    return {"got": got, "calls": calls, "refused": refused, "empty": empty, "codes": codes,
            "slots": slots}


def test_rank0_decides_and_every_rank_reports_reach_every_rank():
    out = spawn(decide_and_report, WORLD, timeout=60)
    for rank, r in enumerate(out):
        assert r["got"] == {"note": "taken by rank 0", "pid": [0, "ü"]}, (rank, r)
        assert r["calls"] == ([0] if rank == 0 else []), (rank, r)
        assert r["refused"] == "the lock is held by host h, pid 7; stop that run", (rank, r)
        assert r["empty"] == ""
        assert r["codes"] == [0, 28, -1], (rank, r)  # an unknown error (-1) survives the sum
        assert r["slots"] == [10 + i for i in range(7)], (rank, r)
