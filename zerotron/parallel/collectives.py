"""The only place zerotron calls torch.distributed collectives.

Every call is counted in the group's ``CommStats`` (ZeRO §7 volumes), skipped when the group
has one member, and runs under the process group's timeout (see ``runtime``). On gloo two gaps
measured with torch 2.13 are filled here: all-gather of uneven sizes (pad to the largest, gather,
trim) and AVG on integer tensors (SUM, then divide rounding toward zero).

Collectives take a ``Group`` from the ``Grid``; ``async_op=True`` returns a ``Handle`` whose
``wait()`` finishes the work (and any post-processing such as trimming the padding).
"""

from __future__ import annotations

import contextlib

import time
from typing import Callable

import torch
import torch.distributed as dist

from zerotron.parallel import runtime
from zerotron.parallel.grid import Group

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "avg": dist.ReduceOp.AVG,
}


class Handle:
    """An in-flight collective; ``wait()`` blocks until it is done and returns its result."""

    def __init__(self, work=None, result=None, finish: Callable[[], object] | None = None,
                 op: str = "", group: Group | None = None, tensor: torch.Tensor | None = None):
        self._work, self._result, self._finish, self._done = work, result, finish, False
        self._op, self._group, self._tensor = op, group, tensor

    def _blocked(self):
        if self._group is None:  # a handle of handles: each inner wait() counts itself
            return contextlib.nullcontext()
        return self._group.stats.waits.blocked(self._tensor)

    def wait(self):
        if not self._done:
            if self._work is not None:
                try:
                    with self._blocked():
                        self._work.wait()
                except RuntimeError as e:
                    raise _explain(self._op, self._group, e) from e
                if self._group is not None and self._group.health is not None:
                    self._group.health.completed(self._work)  # a Work keeps its tensors alive
            if self._finish is not None:
                self._result = self._finish()
            self._done = True
        return self._result


def _explain(op: str, group: Group | None, exc: RuntimeError) -> RuntimeError:
    """Turn a backend error (peer died, timeout) into one that names the responsible rank.

    Under ``ZEROTRON_EMULATE_NCCL=1`` the error never arrives, as under NCCL, whose ``wait()``
    neither raises nor blocks the host, which then sits in its next device read: this thread
    blocks for good and the health watchdog names the culprit and ends the process (exit 3)."""
    if group is None or group.health is None:
        return exc
    if runtime.emulate_nccl():
        group.health.hold(op, group)  # still in flight for the watchdog, as a hung NCCL call is
        while True:
            time.sleep(3600)
    return group.health.diagnose(op, group, exc)


def _launch(op: str, group: Group, tensor: torch.Tensor, numel: int, fn: Callable[[], object],
            peer: int | None = None):
    """Count, (debug) sequence-check and issue one collective (or p2p transfer with ``peer``);
    backend errors name the culprit."""
    group.stats.record(op, group.name, numel, tensor.element_size())
    if group.health is not None:
        group.health.before(op, group, tensor, peer=peer)
    try:
        with group.stats.waits.blocked(tensor):  # a synchronous call blocks until peers arrive
            work = fn()
    except RuntimeError as e:
        raise _explain(op, group, e) from e
    except BaseException:  # refused before it started (bad arguments): nothing is in flight
        if group.health is not None:
            group.health.issued()
        raise
    if group.health is not None:
        group.health.issued(work, tensor)  # the watchdog now follows it until it completes
    return work


def _done(result, async_op: bool):
    return Handle(result=result) if async_op else result


def _reduce_op(op: str, tensor: torch.Tensor):
    if op not in _OPS:
        raise ValueError(f"unknown reduce op {op!r}; use one of {sorted(_OPS)}")
    return _OPS[op]


def all_reduce(tensor: torch.Tensor, group: Group, op: str = "sum", async_op: bool = False):
    """In-place all-reduce of ``tensor`` over ``group``; counts 2Ψ (ZeRO §7)."""
    _reduce_op(op, tensor)
    if group.size == 1:
        return _done(tensor, async_op)
    emulate_avg = op == "avg" and not tensor.is_floating_point()
    red = _OPS["sum" if emulate_avg else op]
    work = _launch("all_reduce", group, tensor, tensor.numel(),
                   lambda: dist.all_reduce(tensor, op=red, group=group.pg, async_op=async_op))

    def finish():
        if emulate_avg:
            tensor.copy_(torch.div(tensor, group.size, rounding_mode="trunc"))
        return tensor

    if async_op:
        return Handle(work, finish=finish, op="all_reduce", group=group, tensor=tensor)
    return finish()


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Group, op: str = "sum", async_op: bool = False):
    """Reduce ``input`` (``group.size`` equal chunks along dim 0) and keep this rank's chunk in ``output``."""
    red = _reduce_op(op, input)
    if input.numel() != output.numel() * group.size:
        raise ValueError(
            f"reduce_scatter: input has {input.numel()} elements, expected output.numel()*group.size = "
            f"{output.numel()}*{group.size}"
        )
    if group.size == 1:
        output.copy_(input.view_as(output))
        return _done(output, async_op)
    if op == "avg" and not input.is_floating_point():
        raise ValueError("reduce_scatter: 'avg' on integer tensors is not supported; use 'sum' and divide")
    work = _launch("reduce_scatter", group, input, input.numel(),
                   lambda: _reduce_scatter_single(output, input, op=red, group=group.pg, async_op=async_op))
    return Handle(work, result=output, op="reduce_scatter", group=group, tensor=input) if async_op else output


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Group, async_op: bool = False):
    """Gather equal-sized ``input`` from every rank into ``output`` (concatenated along dim 0)."""
    if output.numel() != input.numel() * group.size:
        raise ValueError(
            f"all_gather: output has {output.numel()} elements, expected input.numel()*group.size = "
            f"{input.numel()}*{group.size}"
        )
    if group.size == 1:
        output.copy_(input.view_as(output))
        return _done(output, async_op)
    work = _launch("all_gather", group, output, output.numel(),
                   lambda: _all_gather_single(output, input, group=group.pg, async_op=async_op))
    return Handle(work, result=output, op="all_gather", group=group, tensor=output) if async_op else output


def all_gather_uneven(tensor: torch.Tensor, group: Group, sizes: list[int] | None = None, async_op: bool = False):
    """Gather tensors whose dim 0 differs between ranks; returns their concatenation along dim 0.

    gloo cannot gather uneven sizes, so each rank pads to the largest size, the padded tensors
    are gathered, and the padding is cut off. ``sizes`` (dim-0 length per rank) may be given to
    skip the extra all-gather that learns them.
    """
    if group.size == 1:
        return _done(tensor.clone(), async_op)
    if sizes is None:
        mine = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
        everyone = torch.empty(group.size, dtype=torch.int64, device=tensor.device)
        all_gather(everyone, mine, group)
        sizes = everyone.tolist()
    if len(sizes) != group.size or sizes[group.rank_of(dist.get_rank())] != tensor.shape[0]:
        raise ValueError(f"all_gather_uneven: sizes {sizes} do not match this rank's dim 0 {tensor.shape[0]}")
    longest = max(sizes)
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    out = tensor.new_empty((longest * group.size, *tensor.shape[1:]))
    work = all_gather(out, padded, group, async_op=async_op)

    def finish():
        pieces = out.split(longest)
        return torch.cat([p[:n] for p, n in zip(pieces, sizes)])

    return Handle(work, finish=finish) if async_op else finish()


def broadcast(tensor: torch.Tensor, src: int, group: Group, async_op: bool = False):
    """Broadcast ``tensor`` from global rank ``src`` to every member of ``group``."""
    if src not in group.ranks:
        raise ValueError(f"broadcast: src rank {src} is not in group {group.name} {group.ranks}")
    if group.size == 1:
        return _done(tensor, async_op)
    work = _launch("broadcast", group, tensor, tensor.numel(),
                   lambda: dist.broadcast(tensor, src=src, group=group.pg, async_op=async_op))
    return Handle(work, result=tensor, op="broadcast", group=group, tensor=tensor) if async_op else tensor


def all_to_all(output: torch.Tensor, input: torch.Tensor, group: Group, async_op: bool = False):
    """Block ``j`` of ``input`` (``group.size`` equal blocks along dim 0) goes to member ``j``;
    ``output`` receives block ``i`` from member ``i``. Counted as the (n-1)/n that leaves the rank."""
    if input.numel() != output.numel() or input.numel() % group.size:
        raise ValueError(f"all_to_all: input ({input.numel()}) and output ({output.numel()}) must have the same "
                         f"number of elements, divisible by group.size={group.size}")
    if group.size == 1:
        output.copy_(input)
        return _done(output, async_op)
    moved = input.numel() // group.size * (group.size - 1)
    work = _launch("all_to_all", group, input, moved,
                   lambda: dist.all_to_all_single(output, input, group=group.pg, async_op=async_op))
    return Handle(work, result=output, op="all_to_all", group=group, tensor=output) if async_op else output


def barrier(group: Group) -> None:
    """Wait for every member of ``group`` (under the group's timeout)."""
    if group.size > 1:
        if group.health is not None:
            group.health.before("barrier", group, None)  # counted: a peer that never arrives is "behind"
        try:
            dist.barrier(group=group.pg)
        except RuntimeError as e:
            raise _explain("barrier", group, e) from e
        if group.health is not None:
            group.health.issued()
