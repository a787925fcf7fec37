"""Pipeline-parallel training step: 1F1B and all-forward-all-backward (AFAB) schedules.

The model is cut into ``pp`` stages by layers; each rank runs its stage on ``m`` micro-batches
and exchanges activations (forward) and their gradients (backward) with its neighbours in
``grid.pp_group``. Shapes are fixed up front, ``(micro_batch, seq, hidden)``, so no shape is
ever sent. Every transfer is a ``p2p.batch`` (``batch_isend_irecv``), counted in the grid's
``CommStats``; sends and receives of one exchange are posted together so neighbours never
deadlock on the order of blocking calls.

* **AFAB** (GPipe): m forwards, then m backwards. Simple; holds all m micro-batches' activations.
* **1F1B** (PipeDream-Flush / Megatron-LM §2.2): stage ``r`` runs ``pp - r - 1`` warm-up
  forwards, then alternates one forward and one backward, then drains the remaining backwards.
  Same bubble, (pp-1)/(m+pp-1) of the step, but at most ``pp - r`` micro-batches in flight.

The stage is any module: ``stage(token_ids)`` on the first stage, ``stage(hidden)`` otherwise;
``stage(x, labels)`` on the last stage returns the micro-batch's mean loss. Optimizer contract
(duck-typed, ``zerotron.parallel`` imports nothing above it): ``scale_loss``, ``no_sync()``,
``reduce_gradients()``, and optionally ``pipeline_backward(tensors, grad_tensors)``, which then
runs every micro-batch's backward. All backwards run inside ``no_sync()`` -- gradients accumulate
locally over the micro-batches, except that ZeRO stage 2's ``pipeline_backward`` reduces each
backward's buckets into the gradient partition, so Pos+g (ZeRO §5.2) keeps no full gradient
across micro-batches -- then ``after_backward()`` (e.g. the tied-embedding all-reduce), then one
``reduce_gradients()``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from zerotron.parallel import collectives as C
from zerotron.parallel import p2p
from zerotron.parallel.grid import Grid

SCHEDULES = ("1f1b", "afab")


@dataclass
class StepOutput:
    """``loss``: global-batch mean loss (mean of micro-batch means, averaged over DP), on every rank:
    a 0-dim tensor on the stage's device, never read here (``host_sync``: the trainer reads it
    when it logs, so the schedule queues its work without waiting for the device).

    ``compute_s``: time this stage spent in forward/backward; ``wall_s``: the whole schedule
    (including ``after_backward`` and the gradient reduction). ``1 - compute_s / wall_s`` is the
    stage's measured idle (bubble) fraction.
    """

    loss: torch.Tensor
    compute_s: float
    wall_s: float


class _Stage:
    """This rank's stage: its forward/backward on one micro-batch and the exchanges with neighbours."""

    def __init__(self, stage: nn.Module, microbatches, grid: Grid, shape, dtype, device, optimizer):
        self.stage, self.mbs, self.grid, self.opt = stage, microbatches, grid, optimizer
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.first, self.last = grid.is_first_stage, grid.is_last_stage
        self.m = len(microbatches)
        self.loss_sum = torch.zeros((), dtype=torch.promote_types(dtype, torch.float32), device=device)
        self.compute_s = 0.0
        self._fwd = self._bwd = 0  # next micro-batch index to run forward / backward

    # exchanges with neighbours (one batched p2p each) -----------------------------------------------
    def _empty(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def exchange(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        """Post the given sends/receives together; returns (from_prev, from_next)."""
        ops, got_prev, got_next = [], None, None
        if send_next is not None and not self.last:
            ops.append(p2p.P2POp("send", send_next.detach().contiguous(), self.grid.next_pp_rank))
        if send_prev is not None and not self.first:
            ops.append(p2p.P2POp("send", send_prev.contiguous(), self.grid.prev_pp_rank))
        if recv_prev and not self.first:
            got_prev = self._empty()
            ops.append(p2p.P2POp("recv", got_prev, self.grid.prev_pp_rank))
        if recv_next and not self.last:
            got_next = self._empty()
            ops.append(p2p.P2POp("recv", got_next, self.grid.next_pp_rank))
        p2p.batch(ops, self.grid.pp_group).wait()
        return got_prev, got_next

    # compute -------------------------------------------------------------------------------------
    def forward(self, received: torch.Tensor | None):
        """Forward of the next micro-batch; returns (input kept for backward, output)."""
        ids, labels = self.mbs[self._fwd]
        self._fwd += 1
        start = time.perf_counter()
        x = ids if self.first else received.requires_grad_(True)
        out = self.stage(x, labels) if self.last else self.stage(x)
        if self.last:
            self.loss_sum += out.detach().to(self.loss_sum.dtype)
        self.compute_s += time.perf_counter() - start
        return x, out

    def backward(self, x: torch.Tensor, out: torch.Tensor, grad_out: torch.Tensor | None):
        """Backward of the oldest micro-batch in flight; returns the gradient for the previous stage."""
        self._bwd += 1
        start = time.perf_counter()
        run = getattr(self.opt, "pipeline_backward", None) or torch.autograd.backward
        if self.last:
            loss = out / self.m  # global-batch mean = mean over micro-batches of their means
            run(self.opt.scale_loss(loss) if self.opt is not None else loss)
        else:
            run(out, grad_out)
        self.compute_s += time.perf_counter() - start
        return None if self.first else x.grad


def _run_afab(st: _Stage) -> None:
    """All forwards, then all backwards, oldest micro-batch first (GPipe)."""
    in_flight = []
    for _ in range(st.m):
        x, _ = st.exchange(recv_prev=True)
        x, out = st.forward(x)
        st.exchange(send_next=out)
        in_flight.append((x, out))
    for _ in range(st.m):
        x, out = in_flight.pop(0)
        _, grad_out = st.exchange(recv_next=True)
        st.exchange(send_prev=st.backward(x, out, grad_out))


def _run_1f1b(st: _Stage) -> None:
    """Warm-up forwards, steady one-forward-one-backward, cool-down backwards (Megatron-LM §2.2)."""
    warmup = min(st.grid.pp_size - st.grid.pp_rank - 1, st.m)
    steady = st.m - warmup
    in_flight = []
    for _ in range(warmup):  # fill the pipeline
        x, _ = st.exchange(recv_prev=True)
        x, out = st.forward(x)
        st.exchange(send_next=out)
        in_flight.append((x, out))
    received = st.exchange(recv_prev=True)[0] if steady else None
    for i in range(steady):  # steady state: our forward's output goes down as the gradient comes up
        x, out = st.forward(received)
        _, grad_out = st.exchange(send_next=out, recv_next=True)
        in_flight.append((x, out))
        x, out = in_flight.pop(0)
        grad_in = st.backward(x, out, grad_out)
        last = i == steady - 1
        received, _ = st.exchange(send_prev=grad_in, recv_prev=not last)
    for _ in range(warmup):  # drain
        x, out = in_flight.pop(0)
        _, grad_out = st.exchange(recv_next=True)
        st.exchange(send_prev=st.backward(x, out, grad_out))


def train_step(stage: nn.Module, microbatches: Sequence, grid: Grid, shape: Sequence[int], *,
               schedule: str = "1f1b", optimizer=None, after_backward: Callable[[], None] | None = None,
               dtype: torch.dtype = torch.float32, device=None) -> StepOutput:
    """Forward and backward of one global batch through the pipeline; does not step the optimizer.

    ``microbatches``: ``m`` pairs ``(token_ids, labels)`` -- ids are read on the first stage,
    labels on the last (other entries may be None). ``shape``: ``(micro_batch, seq, hidden)`` of
    the activations exchanged between stages, in ``dtype``. With ``optimizer`` (the ZeRO front or
    anything with ``scale_loss``/``no_sync``/``reduce_gradients``) gradients are reduced once at
    the end (or per micro-batch by its ``pipeline_backward``); without one they are left in
    ``.grad`` for the caller to reduce over DP.
    The loss is averaged over DP on the last stage and broadcast to every rank of its pipeline.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"parallel.pipeline_schedule={schedule!r}: use one of {SCHEDULES}")
    if len(microbatches) < 1:
        raise ValueError("train_step: num_microbatches must be >= 1 (got an empty list of micro-batches)")
    if len(shape) != 3 or not all(isinstance(d, int) and d > 0 for d in shape):
        raise ValueError(f"train_step: shape={tuple(shape)!r} must be (micro_batch, seq, hidden), positive ints")
    if grid.pp_size > 1 and getattr(optimizer, "stage", 0) == 3:
        raise ValueError("zero.stage=3 with parallel.pp>1 is not supported (each stage would re-gather its "
                         "parameters for every micro-batch in flight); use zero.stage<=2 with pipelines")
    device = torch.device("cpu") if device is None else torch.device(device)
    st = _Stage(stage, microbatches, grid, shape, dtype, device, optimizer)
    start = time.perf_counter()
    sync = optimizer.no_sync() if optimizer is not None else contextlib.nullcontext()
    with sync:
        (_run_1f1b if schedule == "1f1b" else _run_afab)(st)
    if after_backward is not None:
        after_backward()
    if optimizer is not None:
        optimizer.reduce_gradients()
    loss = st.loss_sum / st.m
    if grid.is_last_stage:  # the global batch's loss: average over the data-parallel replicas
        C.all_reduce(loss, grid.dp_group, op="avg")
    C.broadcast(loss, grid.pp_group.ranks[-1], grid.pp_group)
    return StepOutput(loss, st.compute_s, time.perf_counter() - start)


def microbatches_in_flight(schedule: str, pp_size: int, pp_rank: int, num_microbatches: int) -> int:
    """Most forwards whose backward has not run yet on this stage: the activations it must hold.

    AFAB holds all m; 1F1B holds its warm-up forwards plus one, ``min(pp - pp_rank, m)``, which
    is why it is the default (activation checkpointing sizes its buffers with this).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"parallel.pipeline_schedule={schedule!r}: use one of {SCHEDULES}")
    return num_microbatches if schedule == "afab" else min(pp_size - pp_rank, num_microbatches)


@torch.no_grad()
def eval_step(stage: nn.Module, microbatches: Sequence, grid: Grid, shape: Sequence[int], *,
              dtype=torch.float32, device=None) -> torch.Tensor:
    """Forward-only pass of ``m`` micro-batches through the pipeline; mean loss on every pp rank,
    as a 0-dim float64 tensor on ``device`` (the caller reads it once per evaluation,
    ``host_sync.read``, instead of once per call).

    No backward, so no schedule is needed: each stage receives, computes and sends one
    micro-batch at a time (blocking p2p, which cannot deadlock in a chain).
    """
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for ids, labels in microbatches:
        x = ids
        if not grid.is_first_stage:
            x = p2p.recv(torch.empty(tuple(shape), dtype=dtype, device=device), grid.prev_pp_rank, grid.pp_group)
        out = stage(x, labels) if grid.is_last_stage else stage(x)
        if grid.is_last_stage:
            total += out.double()
        else:
            p2p.send(out, grid.next_pp_rank, grid.pp_group)
    C.broadcast(total, grid.pp_group.ranks[-1], grid.pp_group)
    return total[0] / max(len(microbatches), 1)
