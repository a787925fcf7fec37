"""Point-to-point transfers between pipeline stages, counted like the collectives.

``send``/``recv`` block; ``batch`` posts several sends and receives at once
(``torch.distributed.batch_isend_irecv``: one NCCL group) so a stage can exchange with both
neighbours without ordering deadlocks, and returns at once: the pipeline schedules post the
next micro-batch's transfers before computing the current one (``pipeline_schedules``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerotron.parallel.collectives import Handle, _explain, _launch
from zerotron.parallel.grid import Group


def _check_peer(peer: int, group: Group) -> None:
    if peer not in group.ranks:
        raise ValueError(f"p2p peer rank {peer} is not in group {group.name} {group.ranks}")


def send(tensor: torch.Tensor, dst: int, group: Group) -> None:
    _check_peer(dst, group)
    _launch("send", group, tensor, tensor.numel(), lambda: dist.send(tensor.contiguous(), dst=dst, group=group.pg),
            peer=dst)


def recv(tensor: torch.Tensor, src: int, group: Group) -> torch.Tensor:
    _check_peer(src, group)
    _launch("recv", group, tensor, tensor.numel(), lambda: dist.recv(tensor, src=src, group=group.pg), peer=src)
    return tensor


@dataclass
class P2POp:
    """One transfer of a batch: ``kind`` is ``"send"`` or ``"recv"``, ``peer`` a global rank."""

    kind: str
    tensor: torch.Tensor
    peer: int


def batch(ops: list[P2POp], group: Group) -> Handle:
    """Post every send and receive of ``ops`` together; ``wait()`` completes them all."""
    if not ops:
        return Handle()
    torch_ops = []
    for op in ops:
        if op.kind not in ("send", "recv"):
            raise ValueError(f"P2POp.kind={op.kind!r}: use 'send' or 'recv'")
        _check_peer(op.peer, group)
        fn = dist.isend if op.kind == "send" else dist.irecv
        torch_ops.append(dist.P2POp(fn, op.tensor, op.peer, group=group.pg))
    for op in ops:  # count each transfer; a failure below names the dead or stuck peer
        group.stats.record(op.kind, group.name, op.tensor.numel(), op.tensor.element_size())
        if group.health is not None:
            group.health.before(op.kind, group, op.tensor, peer=op.peer)
    try:
        works = dist.batch_isend_irecv(torch_ops)
    except RuntimeError as e:
        raise _explain("p2p", group, e) from e
    works = list(works)
    if group.health is not None:
        group.health.issued(works, ops[0].tensor)

    def finish():
        try:
            with group.stats.waits.blocked(ops[0].tensor):  # the stage's stall on its peers
                for w in works:
                    w.wait()
        except RuntimeError as e:
            raise _explain("p2p", group, e) from e
        if group.health is not None:  # the works hold the buffers: let them go with the handle
            group.health.completed(works)
        return [op.tensor for op in ops]

    return Handle(finish=finish)
