"""Who a failed or late collective waits for: the heartbeats of the ranks it names, followed to the root.

``health.Health`` publishes each rank's heartbeat -- time, per-group counts, in-flight links,
last collective, verdict -- to the rendezvous store; ``blame`` reads them for the links of one
wait and says which rank(s) everyone waits for, and why (dead or frozen, alive but stuck behind,
gave up blaming another).
"""

from __future__ import annotations

import time
from typing import Callable

MAX_CHAIN = 8  # ranks followed from "behind" to "behind" before giving up on finding the root


def blame(read: Callable[[int], dict | None], rank: int, links: list, heartbeat_s: float) -> list[tuple[int, str]]:
    """Follow ``links`` through the heartbeats to the rank(s) everyone waits for.

    Two reads ``2.5 * heartbeat_s`` apart tell live ranks (timestamp moved) from dead or
    frozen ones; counts say who is behind; a behind rank's own in-flight links say whom it
    waits for in turn."""
    first: dict[int, dict | None] = {}

    def explore(links, depth):
        for m, waits in _by_member(links).items():
            if m == rank or m in first:
                continue
            beat = first[m] = read(m)
            if beat and _behind(beat, waits) and depth < MAX_CHAIN:
                explore(beat.get("inflight", []), depth + 1)

    explore(links, 0)
    time.sleep(2.5 * heartbeat_s)  # a live rank's heartbeat moves on in the meantime
    later = {m: read(m) for m in first}
    findings: list[tuple[int, str]] = []
    seen = {rank}

    def judge(links, depth, via):
        for m, waits in _by_member(links).items():
            if m in seen or m not in first:
                continue
            seen.add(m)
            beat, now = first[m], later[m]
            if beat is None and now is None:
                findings.append((m, f"{via}rank {m} has no readable heartbeat (it died before publishing "
                                    f"one, or the launcher's store is gone because a worker died)"))
            elif now is None or beat is None or now["t"] == beat["t"]:
                last = now or beat
                verdict = last.get("verdict")
                if verdict:  # it gave up first, having named the root
                    findings.extend((r, f"{via}rank {m} exited blaming: {verdict['text']}")
                                    for r in verdict["blame"])
                else:
                    findings.append((m, f"{via}rank {m} is dead or frozen (its heartbeat stopped; "
                                        f"{_last_beat(last)})"))
            elif key := _behind(now, waits):
                before = len(findings)
                if depth < MAX_CHAIN:
                    judge(beat.get("inflight", []), depth + 1, f"{via}rank {m} is behind on {key}, waiting for: ")
                if len(findings) == before and now.get("verdict"):  # it gave up, naming the root
                    findings.extend((r, f"{via}rank {m} failed blaming: {now['verdict']['text']}")
                                    for r in now["verdict"]["blame"])
                elif len(findings) == before:
                    findings.append((m, f"{via}rank {m} is alive but stuck behind: it is at "
                                        f"{now['last'] or 'start-up'}"))

    judge(links, 0, "")
    return findings


def _last_beat(beat: dict) -> str:
    """What a stopped rank's final heartbeat showed, dated: it was published up to ``heartbeat_s``
    before the rank stopped, which may have issued more collectives since. The clock time, not an
    age, so that the same beat quoted by other ranks' verdicts reads the same (and stays true)."""
    where = f"at {beat['last']}" if beat["last"] else "before its first collective"
    stamp = time.strftime("%H:%M:%S", time.gmtime(beat["t"])) + f".{int(beat['t'] * 10) % 10} UTC"
    return f"the last one, at {stamp}, had it {where}"


def _by_member(links: list) -> dict[int, list]:
    """``{rank: [(key, sequence number), ...]}``: every link that waits for a rank (a p2p batch holds
    several transfers to one peer, which is behind if it has not made the last of them)."""
    out: dict[int, list] = {}
    for key, members, seq in links:
        for m in members:
            out.setdefault(m, []).append((key, seq))
    return out


def _behind(beat: dict, waits: list) -> str | None:
    """The first link on which ``beat``'s rank has not yet issued what we wait for, or None."""
    return next((key for key, seq in waits if beat["counts"].get(key, 0) < seq), None)
