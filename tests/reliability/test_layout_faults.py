"""A stuck rank is named in every layout through the real entry point, and the job exits 3.

``scripts/pretrain_gpt.py``'s ``main`` on 4 forked gloo ranks as TP2xDP2 and TP2xPP2 with an 8 s
collective timeout; rank 1 stalls at the start of step 3 (its heartbeat keeps beating). Its TP
peer waits in a TP all-reduce, the others in a DP reduction or a pipeline receive -- groups that
are not the world group, so without the timeout on every group they would wait 30 minutes.
The stall lasts ``timeout + 10`` s: "alive but stuck behind" in a survivor's error proves it
named rank 1 before then (a rank that woke up and exited would read "dead").
"""

from __future__ import annotations

import re

import pytest

from tests.reliability.common import start, tiny

TIMEOUT_S = 8.0


LAYOUTS = {"tp2xdp2": ["--tp", "2"], "tp2xpp2": ["--tp", "2", "--pp", "2"]}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_stuck_rank_is_named_by_every_survivor(zerotron_cache, tmp_path_factory, name, overlap, request):
    def drill(params):
        run_dir = tmp_path_factory.mktemp(params["name"])
        argv = tiny(zerotron_cache) + ["--train-steps", "6", "--run-dir", str(run_dir)] + LAYOUTS[params["name"]]
        return start(argv, world=4, fault="stall@step=3@rank=1", env={"ZEROTRON_FAULT_STALL_S": str(TIMEOUT_S + 10)},
                     may_die=(1,), collective_timeout=TIMEOUT_S)

    with overlap.ranks(request, drill) as ranks:  # the other layout's drill waits out its timeout meanwhile
        res = ranks.wait(timeout=150)
    for rank in (0, 2, 3):
        code, _, err, _ = res[rank]
        assert code == 3, f"rank {rank}: {err}"
        assert "CollectiveError" in err and "rank 1 is alive but stuck behind" in err, f"rank {rank}: {err}"
        blamed = set(re.findall(r"rank (\d+) (?:is dead or frozen|is alive but stuck)", err))
        assert blamed == {"1"}, f"rank {rank}: {err}"
        waited = re.findall(r"zerotron watchdog: .* has waited (\d+)s", err)
        error = next(line for line in err.splitlines() if "CollectiveError" in line)
        print(f"{name}: rank {rank} exit {code}, watchdog named rank 1 after {waited}s; {error[:400]}")
