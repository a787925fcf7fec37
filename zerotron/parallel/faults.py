"""Fault-injection hooks for the reliability drills (tests/reliability, scripts/drill.py). TEST HOOK ONLY.

Off unless ``ZEROTRON_FAULT`` is set, and then a single string compare per call site. Syntax::

    ZEROTRON_FAULT=<point>[@step=N][@rank=R]      e.g. kill_after_shard@step=4@rank=1

Points (each fires once, on the matching rank -- every rank when ``@rank`` is absent -- at the
matching step -- any step when ``@step`` is absent):

* ``kill_after_shard``   checkpoint/write.py: this rank's shard is written, the checkpoint
                         is not yet committed -> ``os._exit(9)`` (a writer crash mid-checkpoint)
* ``kill_before_commit`` checkpoint/write.py: metadata.json written, ``.tmp`` not renamed
* ``hold_writer``        async_save's writer thread, before it writes: waits as ``pause`` does, while
                         the loop trains on -- a background write in flight for a drill to kill -9
* ``kill_in_writer``     async_save's writer thread (checkpoint.async_save): this rank's shard and its
                         sidecar are written, the checkpoint is not committed, the loop trains on
                         -> ``os._exit(9)`` from that thread (a rank killed during a background save)
* ``enospc``             checkpoint/write.py: this rank's shard write raises ``OSError(ENOSPC)``,
                         as a full disk of this rank's node alone would (the ranks of one host share
                         a file system: a real full disk cannot single out one of them)
* ``kill``               trainer, start of a step -> ``os._exit(9)`` (a rank dies, like kill -9)
* ``stall``              trainer, start of a step: sleeps ``ZEROTRON_FAULT_STALL_S`` seconds (default
                         3600; the heartbeat thread keeps running: "alive but stuck"), then exits 9
* ``slow``               trainer, start of a step: computes for ``ZEROTRON_FAULT_SLOW_S`` seconds
                         (default 0.5; a busy loop, as a slower device or more work would) and goes
                         on: a straggler, alive but slow (``training/stragglers.py``)
* ``nan``                trainer, start of a step: fills the first parameter with NaN (a blown-up weight)
* ``pause``              trainer, start of a step: waits until the file ``ZEROTRON_FAULT_PAUSE_FILE``
                         exists (at most ``ZEROTRON_FAULT_STALL_S`` s), then goes on. Armed on every
                         rank, no collective is pending meanwhile: a run that is still busy, however
                         fast it trains, while the drill starts a second run on its directory
"""

from __future__ import annotations

import errno
import os
import sys
import time

EXIT_CODE = 9


def _spec() -> tuple[str, int | None, int | None] | None:
    raw = os.environ.get("ZEROTRON_FAULT", "").strip()
    if not raw:
        return None
    point, *rest = raw.split("@")
    step = rank = None
    for part in rest:
        key, _, value = part.partition("=")
        if key == "step":
            step = int(value)
        elif key == "rank":
            rank = int(value)
        else:
            raise ValueError(f"ZEROTRON_FAULT={raw!r}: unknown qualifier {key!r}; use @step=N and/or @rank=R")
    return point, step, rank


def armed(point: str, step: int, rank: int) -> bool:
    """True when ``ZEROTRON_FAULT`` names ``point`` for this step and rank."""
    spec = _spec()
    if spec is None or spec[0] != point:
        return False
    _, want_step, want_rank = spec
    return (want_step is None or want_step == step) and (want_rank is None or want_rank == rank)


def hit(point: str, step: int, rank: int, path: os.PathLike | str | None = None) -> None:
    """Kill (``kill*``), stall (``stall``) or pause (``pause``) this process, or raise ENOSPC writing
    ``path`` (``enospc``), when ``point`` is armed; else nothing."""
    if not armed(point, step, rank):
        return
    print(f"[fault] rank {rank}: injected {point} at step {step}", file=sys.stderr, flush=True)
    if point == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    if point in ("pause", "hold_writer"):
        until = time.monotonic() + float(os.environ.get("ZEROTRON_FAULT_STALL_S", "3600"))
        release = os.environ.get("ZEROTRON_FAULT_PAUSE_FILE", "")
        while time.monotonic() < until and not (release and os.path.exists(release)):
            time.sleep(0.1)
        return
    if point == "slow":
        until = time.thread_time() + float(os.environ.get("ZEROTRON_FAULT_SLOW_S", "0.5"))
        while time.thread_time() < until:  # this thread's own CPU time, however loaded the host
            pass
        return
    if point == "stall":
        time.sleep(float(os.environ.get("ZEROTRON_FAULT_STALL_S", "3600")))
    os._exit(EXIT_CODE)
