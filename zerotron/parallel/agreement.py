"""Rank 0 decides, every rank agrees: one outcome on every rank before any rank acts on it.

Some steps only one rank may take -- a directory's lock, a shared cache, making or renaming a
checkpoint directory -- and others every rank takes on its own -- writing its shard, hashing its
share of a checkpoint's files. Either can fail on one rank alone. A rank that raises while its
peers go on to the next collective leaves them blocked until the collective timeout names a
"dead" peer instead of the cause, so the outcome is made common first:

* ``rank0_decides``: rank 0 acts; its value -- or the error it hit -- reaches every rank, which
  returns the same value or raises the same error class with rank 0's message.
* ``every_rank_reports``: each rank fills the entries it owns (its rank, the files it hashed);
  every rank gets the whole list and so reaches the same verdict.

Both go through ``collectives.py`` (counted, under the group's timeout).
"""

from __future__ import annotations

import json
from typing import Any, Callable

import torch

from zerotron.parallel import collectives as C
from zerotron.parallel import host_sync


def _text_from_rank0(text: str, grid, device: torch.device) -> str:
    """Rank 0's ``text`` on every rank: its length, then its UTF-8 bytes (two broadcasts)."""
    data = text.encode() if grid.rank == 0 else b""
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    C.broadcast(n, 0, grid.world_group)
    size = int(host_sync.read(n, "agree", placeholder=0))
    if size == 0:
        return ""
    buf = (torch.tensor(list(data), dtype=torch.uint8, device=device) if grid.rank == 0
           else torch.empty(size, dtype=torch.uint8, device=device))
    C.broadcast(buf, 0, grid.world_group)
    return bytes(buf.cpu().tolist()).decode()


def rank0_decides(decide: Callable[[], Any], grid, device: torch.device, *,
                  failures: tuple[type[Exception], ...] = ()) -> Any:
    """Collective: rank 0 calls ``decide()``; every rank returns its result (a JSON value).

    An exception of one of the ``failures`` classes on rank 0 is raised on every rank: rank 0
    re-raises its own, the others the same class with rank 0's message (so each class must take
    the message as its one argument). Any other exception is a bug and stays on rank 0."""
    outcome = ""
    if grid.rank == 0:
        try:
            outcome = json.dumps({"value": decide()})
        except failures as e:
            kind = next(i for i, cls in enumerate(failures) if isinstance(e, cls))
            _text_from_rank0(json.dumps({"failure": kind, "message": str(e)}), grid, device)
            raise
    got = json.loads(_text_from_rank0(outcome, grid, device))
    if "failure" in got:
        raise failures[got["failure"]](got["message"])
    return got["value"]


def every_rank_reports(own: dict[int, int], size: int, grid, device: torch.device,
                       reason: str = "agree") -> list[int]:
    """Collective: the ``size`` integer entries each rank fills for the slots it owns (``own``:
    slot -> value, 0 for nothing to report), as one list on every rank. Each slot belongs to one
    rank (the others leave it 0), so the sum over ranks is that rank's value, negative ones too."""
    codes = torch.zeros(size, dtype=torch.int64, device=device)
    for slot, value in own.items():
        codes[slot] = value
    if grid.world_size > 1:
        C.all_reduce(codes, grid.world_group, op="sum")
    values = host_sync.read(codes, reason, placeholder=[0] * size)
    return [int(v) for v in (values if isinstance(values, list) else [values])]
