"""Pipeline-parallel training and evaluation steps: run this rank's program of the AFAB, 1F1B or
interleaved 1F1B schedule (``pipeline_schedules``), exchanging activations and gradients with
its neighbours in ``grid.pp_group``.

The stage is one callable, or ``v`` model chunks (``stage.pipeline_chunks()`` or a list):
``chunk(token_ids)`` on virtual stage 0, ``chunk(hidden)`` elsewhere, ``chunk(x, labels)`` on the
last virtual stage returning the micro-batch's mean loss. Shapes are fixed up front,
``(micro_batch, seq, hidden)``, so no shape is ever sent.

Transfers are ``p2p.batch`` (``batch_isend_irecv``), posted asynchronously where the program
says, so the input of the next micro-batch travels while this rank computes another. Before each
compute the rank completes the batches ``pipeline_schedules.waits`` names: the one holding the
compute's own receive, those posted before the previous compute and, when outputs are freed,
the activation just sent (``pipeline_sim`` proves the placement and these waits deadlock-free
under NCCL's in-order stream, with the formula bubble).

Every output is **freed** once sent (Megatron's ``deallocate_output_tensor``): autograd needs the
output's ``grad_fn``, not its values, so its storage is swapped for one element broadcast to its
shape -- the backward call still sees the right shape -- and the memory goes when the send lets go
of it, which the next compute waits for (gloo cannot tell a send is done otherwise). A stage's
peak then holds ``(in flight - 1) x b·s·h`` fewer elements, the output being computed being the
one left (``scripts/bench/pipeline.py`` measures it).

Optimizer contract (duck-typed, ``zerotron.parallel`` imports nothing above it): ``scale_loss``,
``no_sync()``, ``reduce_gradients()``, and optionally ``pipeline_backward(tensors, grad_tensors)``,
which then runs every backward. All backwards run inside ``no_sync()`` -- gradients accumulate
locally over the micro-batches, except that ZeRO stage 2's ``pipeline_backward`` reduces each
backward's buckets into the gradient partition, so Pos+g (ZeRO §5.2) keeps no full gradient across
micro-batches -- then ``after_backward()`` (the tied-embedding all-reduce), then one
``reduce_gradients()``.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from zerotron.parallel import collectives as C
from zerotron.parallel import p2p
from zerotron.parallel.grid import Grid
from zerotron.parallel.pipeline_clock import Clock
from zerotron.parallel.pipeline_schedules import (SCHEDULES, Batch, Op, check_schedule,  # noqa: F401
                                                  microbatches_in_flight, program, waits)


@dataclass
class StepOutput:
    """``loss``: global-batch mean loss (mean of micro-batch means, averaged over DP), on every rank:
    a 0-dim tensor on the stage's device, never read here (``host_sync``: the trainer reads it
    when it logs, so the schedule queues its work without waiting for the device).

    ``compute_s``: time this rank spent in forwards/backwards; ``wall_s``: the whole schedule
    (with ``after_backward`` and the gradient reduction); ``1 - compute_s / wall_s`` is the rank's
    measured bubble. On a GPU both come from CUDA events, resolved (one host sync) when first read.
    """

    loss: torch.Tensor
    clock: Clock

    @property
    def compute_s(self) -> float:
        return self.clock.compute_s()

    @property
    def wall_s(self) -> float:
        return self.clock.wall_s()


def stage_chunks(stage) -> list[Callable]:
    """The model chunks of a stage: a list as given, ``stage.pipeline_chunks()``, or the stage itself."""
    if isinstance(stage, (list, tuple)):
        return list(stage)
    chunks = getattr(stage, "pipeline_chunks", None)
    return list(chunks()) if callable(chunks) else [stage]


def _release(out: torch.Tensor) -> None:
    """Free ``out``'s values, keep its autograd node: one element, broadcast to the same shape."""
    if out.requires_grad and out._base is None and out.numel() > 1:
        out.data = torch.empty((), dtype=out.dtype, device=out.device).expand(out.shape)


class _Run:
    """One rank's execution of its program: buffers, in-flight batches, the compute of each op."""

    def __init__(self, chunks, microbatches, grid: Grid, shape, dtype, device, optimizer, train: bool,
                 free_outputs: bool, clock: Clock, memory):
        self.chunks, self.mbs, self.grid, self.opt = chunks, microbatches, grid, optimizer
        self.shape, self.dtype, self.device, self.train = tuple(shape), dtype, device, train
        self.free, self.clock, self.mem = free_outputs and train, clock, memory
        self.p, self.r, self.v, self.m = grid.pp_size, grid.pp_rank, len(chunks), len(microbatches)
        acc = torch.promote_types(dtype, torch.float32) if train else torch.float64
        self.loss_sum = torch.zeros((), dtype=acc, device=device)
        self.received: dict[tuple, torch.Tensor] = {}  # (kind, chunk, mb) -> buffer of a posted receive
        self.outgoing: dict[tuple, torch.Tensor] = {}  # (kind, chunk, mb) -> produced, not yet posted
        self.kept: dict[tuple, tuple] = {}  # (chunk, mb) -> (input, output) from forward to backward
        self.inflight: deque = deque()  # (batch number, Handle): posted, not yet waited for
        self.posted = self.computes = 0
        self.waits: list[int] = []  # per compute: the batch completed (with all before it) first

    def _phase(self, name: str):
        return self.mem.phase(name) if self.mem is not None else contextlib.nullcontext()

    def _is_first(self, chunk: int) -> bool:
        return chunk == 0 and self.r == 0

    def _is_last(self, chunk: int) -> bool:
        return chunk == self.v - 1 and self.r == self.p - 1

    # transfers ----------------------------------------------------------------------------------
    def post(self, batch: Batch) -> None:
        ops, peers = [], self.grid.pp_group.ranks
        for msg in batch.msgs:
            key = (msg.kind, msg.chunk, msg.mb)
            if msg.send:
                ops.append(p2p.P2POp("send", self.outgoing.pop(key), peers[msg.peer]))
                continue
            with self._phase("forward" if msg.kind == "A" else "backward"):  # what the buffer will hold
                buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            self.received[key] = buf
            ops.append(p2p.P2POp("recv", buf, peers[msg.peer]))
        self.inflight.append((self.posted, p2p.batch(ops, self.grid.pp_group)))
        self.posted += 1
        if self.free:  # the send holds its own reference: the values live until it has gone out
            for msg in batch.msgs:
                if msg.send and msg.kind == "A":
                    _release(self.kept[(msg.chunk, msg.mb)][1])

    def _settle(self) -> None:
        """Before a compute, complete the batches ``pipeline_schedules.waits`` names -- its own
        receive, and sends old enough (their buffers, released outputs among them, go with them:
        gloo cannot tell a send is done without waiting for it)."""
        n = self.waits[self.computes]
        while self.inflight and self.inflight[0][0] <= n:
            self.inflight.popleft()[1].wait()
        self.computes += 1

    def finish(self) -> None:
        while self.inflight:
            self.inflight.popleft()[1].wait()
        if self.received or self.outgoing or self.kept:
            raise RuntimeError(f"pipeline program left work undone on pp rank {self.r}: received "
                               f"{sorted(self.received)}, unsent {sorted(self.outgoing)}, kept {sorted(self.kept)}")

    # compute ------------------------------------------------------------------------------------
    def forward(self, op: Op) -> None:
        c, i = op.chunk, op.mb
        ids, labels = self.mbs[i]
        self._settle()
        x = ids if self._is_first(c) else self.received.pop(("A", c, i))
        if self.train and not self._is_first(c):
            x.requires_grad_(True)
        with self.clock.compute(), self._phase("forward"):
            out = self.chunks[c](x, labels) if self._is_last(c) else self.chunks[c](x)
            if self._is_last(c):
                self.loss_sum += out.detach().to(self.loss_sum.dtype)
        if not self._is_last(c):
            self.outgoing[("A", c, i)] = out.detach()
        if self.train:
            self.kept[(c, i)] = (x, out)

    def backward(self, op: Op) -> None:
        c, i = op.chunk, op.mb
        x, out = self.kept.pop((c, i))
        self._settle()
        grad = None if self._is_last(c) else self.received.pop(("G", c, i))
        run = getattr(self.opt, "pipeline_backward", None) or torch.autograd.backward
        with self.clock.compute(), self._phase("backward"):
            if grad is None:
                loss = out / self.m  # global-batch mean = mean over micro-batches of their means
                run(self.opt.scale_loss(loss) if self.opt is not None else loss)
            else:
                run(out, grad)
        if not self._is_first(c):
            self.outgoing[("G", c, i)] = x.grad

    def run(self, prog: list) -> None:
        self.waits = waits(prog, release_sends=self.free)
        for item in prog:
            if isinstance(item, Batch):
                self.post(item)
            elif item.kind == "F":
                self.forward(item)
            else:
                self.backward(item)
        self.finish()


def _check(schedule, microbatches, shape, grid, v) -> None:
    if len(microbatches) < 1:
        raise ValueError("train_step: num_microbatches must be >= 1 (got an empty list of micro-batches)")
    if len(shape) != 3 or not all(isinstance(d, int) and d > 0 for d in shape):
        raise ValueError(f"train_step: shape={tuple(shape)!r} must be (micro_batch, seq, hidden), positive ints")
    check_schedule(schedule, grid.pp_size, len(microbatches), v)


def train_step(stage, microbatches: Sequence, grid: Grid, shape: Sequence[int], *, schedule: str = "1f1b",
               optimizer=None, after_backward: Callable[[], None] | None = None, dtype: torch.dtype = torch.float32,
               device=None, free_outputs: bool = True, memory=None) -> StepOutput:
    """Forward and backward of one global batch through the pipeline; does not step the optimizer.

    ``microbatches``: ``m`` pairs ``(token_ids, labels)`` -- ids are read on virtual stage 0,
    labels on the last (other entries may be None). ``shape``: ``(micro_batch, seq, hidden)`` of
    the activations exchanged, in ``dtype``. With ``optimizer`` (the ZeRO front or anything with
    ``scale_loss``/``no_sync``/``reduce_gradients``) gradients are reduced once at the end (or per
    micro-batch by its ``pipeline_backward``); without one they are left in ``.grad``.
    ``memory``: anything with ``phase(name)`` (a ``MemoryTracker``): each forward and backward
    runs in its phase, so what a forward leaves alive is counted as activations.
    The loss is averaged over DP on the last stage and broadcast to every rank of its pipeline.
    """
    chunks = stage_chunks(stage)
    _check(schedule, microbatches, shape, grid, len(chunks))
    if grid.pp_size > 1 and getattr(optimizer, "stage", 0) == 3:
        raise ValueError("zero.stage=3 with parallel.pp>1 is not supported (each stage would re-gather its "
                         "parameters for every micro-batch in flight); use zero.stage<=2 with pipelines")
    device = torch.device("cpu") if device is None else torch.device(device)
    clock = Clock(device)
    run = _Run(chunks, microbatches, grid, shape, dtype, device, optimizer, True, free_outputs, clock, memory)
    prog = program(schedule, grid.pp_size, grid.pp_rank, len(microbatches), len(chunks))
    sync = optimizer.no_sync() if optimizer is not None else contextlib.nullcontext()
    with sync:
        run.run(prog)
    if after_backward is not None:
        after_backward()
    if optimizer is not None:
        optimizer.reduce_gradients()
    loss = run.loss_sum / run.m
    if grid.is_last_stage:  # the global batch's loss: average over the data-parallel replicas
        C.all_reduce(loss, grid.dp_cp_group, op="avg")  # x CP: a CP rank's loss is cp x its share
    C.broadcast(loss, grid.pp_group.ranks[-1], grid.pp_group)
    clock.stop()
    return StepOutput(loss, clock)


@torch.no_grad()
def eval_step(stage, microbatches: Sequence, grid: Grid, shape: Sequence[int], *,
              dtype=torch.float32, device=None) -> torch.Tensor:
    """Forward-only pass of ``m`` micro-batches through the pipeline (every chunk, in the schedule's
    forward order); mean loss on every pp rank, as a 0-dim float64 tensor on ``device`` (the
    caller reads it once per evaluation, ``host_sync.read``, instead of once per call)."""
    chunks = stage_chunks(stage)
    _check("1f1b", microbatches, shape, grid, len(chunks))
    device = torch.device("cpu") if device is None else torch.device(device)
    run = _Run(chunks, microbatches, grid, shape, dtype, device, None, False, False, Clock(device), None)
    run.run(program("1f1b", grid.pp_size, grid.pp_rank, len(microbatches), len(chunks), forward_only=True))
    total = run.loss_sum.reshape(1)
    C.broadcast(total, grid.pp_group.ranks[-1], grid.pp_group)
    return total[0] / len(microbatches)
