"""A checkpoint write that fails on one rank stops every rank together, naming that rank and why.

Every rank writes its own shard, so a full disk (``ENOSPC``) or a quota hits some ranks and not
others. Were the failing rank to raise alone, the others would wait in the save's next barrier
until the collective timeout and then blame it as "dead or frozen" -- true of the process, false
of the cause. So each step of a save ends in ``agree``: every rank's ``errno`` (0: written)
reaches every rank (``parallel/agreement.every_rank_reports``) in place of a barrier. A non-zero
entry makes every rank raise the same ``CheckpointWriteError`` -- "disk full on rank 3" -- and
rank 0 removes the partial ``.tmp`` directory (giving back what the failed write took). The
checkpoint before it is still the newest complete one (nothing is pruned before a commit), so the
same command resumes from it once there is room.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import torch

from zerotron.parallel.agreement import every_rank_reports
from zerotron.checkpoint.files import CheckpointError, complete_checkpoints

UNKNOWN = -1  # an OSError without an errno
CAUSES = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded", errno.EROFS: "read-only file system",
          errno.EACCES: "permission denied", errno.EIO: "I/O error"}


class CheckpointWriteError(CheckpointError):
    """A rank could not write its part of a checkpoint; raised on every rank with the same text."""


def cause(code: int) -> str:
    return CAUSES.get(code) or (os.strerror(code) if code > 0 else "unknown OS error")


def agree(error: OSError | None, grid, device: torch.device, tmp: Path, step: int) -> None:
    """Collective: every rank passes its write's ``OSError`` (None: written). Returns when no rank
    failed; otherwise rank 0 removes ``tmp`` and every rank raises ``CheckpointWriteError``."""
    own = {grid.rank: (error.errno or UNKNOWN) if error is not None else 0}
    values = every_rank_reports(own, grid.world_size, grid, device, "checkpoint")
    failed = {r: v for r, v in enumerate(values) if v}
    if not failed:
        return
    if grid.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    raise CheckpointWriteError(message(failed, tmp, step, error if grid.rank in failed else None))


def message(failed: dict[int, int], tmp: Path, step: int, own: OSError | None) -> str:
    """``checkpoint step_… was not written: disk full on rank 3; …`` with the fix and what survives."""
    by_cause: dict[str, list[int]] = {}
    for rank, code in sorted(failed.items()):
        by_cause.setdefault(cause(code), []).append(rank)
    what = "; ".join(f"{c} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}" for c, r in by_cause.items())
    save = tmp.parent
    done = complete_checkpoints(save)
    intact = (f"the newest complete checkpoint, {done[-1]}, is intact" if done
              else "there is no earlier complete checkpoint")
    detail = f" (this rank: {own.strerror or own}: {own.filename})" if own is not None and own.filename else ""
    fix = ("free space there" if any(c in (errno.ENOSPC, errno.EDQUOT) for c in failed.values())
           else "fix the file system or point checkpoint.save elsewhere")
    return (f"checkpoint step_{step:08d} was not written: {what}{detail}; the partial {tmp.name} was removed and "
            f"{intact}. {fix.capitalize()} and rerun the same command: checkpoint.load=auto resumes from the "
            f"newest complete checkpoint in {save}")
