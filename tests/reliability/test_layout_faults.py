"""A stuck rank is named in every layout through the real entry point, and the job exits 3.

``scripts/pretrain_gpt.py``'s ``main`` on forked gloo ranks as TP2xDP2, TP2xPP2, TP2xCP2 (4
ranks) and TP2xPP2xDP2 (8) with an 8 s collective timeout; one rank stalls at the start of step 3
(its heartbeat keeps beating). Its TP peer waits in a TP all-reduce, the others in a DP
reduction, a pipeline transfer or the CP ring's exchange -- groups that are not the world group, so without the timeout on every group
they would wait 30 minutes. The stall lasts ``timeout + 10`` s: "alive but stuck behind" in a
survivor's error proves it named the rank before then (a rank that woke up and exited would read
"dead").
"""

from __future__ import annotations

import re

import pytest

from tests.reliability.common import start, tiny

TIMEOUT_S = 8.0


LAYOUTS = {  # name: (flags, ranks, the rank that stalls)
    "tp2xdp2": (["--tp", "2"], 4, 1),
    "tp2xpp2": (["--tp", "2", "--pp", "2"], 4, 1),
    # one micro-batch: a first-stage rank's last transfers (send #n, receive #n+1) are one batch to a peer
    # that has made #n and waits for the stuck rank through a DP reduction and the other pipeline
    "tp2xpp2xdp2": (["--tp", "2", "--pp", "2"], 8, 1),
    # ranks 2 and 3 wait for the stuck rank through the CP ring's p2p exchanges inside attention
    "tp2xcp2": (["--tp", "2", "--cp", "2"], 4, 1),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_stuck_rank_is_named_by_every_survivor(zerotron_cache, tmp_path_factory, name, overlap, request):
    def drill(params):
        run_dir = tmp_path_factory.mktemp(params["name"])
        flags, world, stuck = LAYOUTS[params["name"]]
        argv = tiny(zerotron_cache) + ["--train-steps", "6", "--run-dir", str(run_dir)] + flags
        return start(argv, world=world, fault=f"stall@step=3@rank={stuck}",
                     env={"ZEROTRON_FAULT_STALL_S": str(TIMEOUT_S + 10)}, may_die=(stuck,), collective_timeout=TIMEOUT_S)

    _, world, stuck = LAYOUTS[name]
    with overlap.ranks(request, drill) as ranks:  # the other layout's drill waits out its timeout meanwhile
        res = ranks.wait(timeout=150)
    for rank in (r for r in range(world) if r != stuck):
        code, _, err, _ = res[rank]
        assert code == 3, f"rank {rank}: {err}"
        assert "CollectiveError" in err and f"rank {stuck} is alive but stuck behind" in err, f"rank {rank}: {err}"
        blamed = set(re.findall(r"rank (\d+) (?:is dead or frozen|is alive but stuck)", err))
        assert blamed == {str(stuck)}, f"rank {rank}: {err}"
        waited = re.findall(r"zerotron watchdog: .* has waited (\d+)s", err)
        error = next(line for line in err.splitlines() if "CollectiveError" in line)
        print(f"{name}: rank {rank} exit {code}, watchdog named rank {stuck} after {waited}s; {error[:400]}")
