"""Which forward and backward each pipeline rank runs when, and which transfers it posts between
them: the AFAB, 1F1B and interleaved 1F1B schedules as pure data (no tensors, no processes).

A rank's *program* is a list of ``Op`` (run one model chunk forward or backward on one
micro-batch) and ``Batch`` (post these sends and receives together, asynchronously). The
executor (``pipeline.py``) runs it; ``pipeline_sim.py`` proves, without processes, that the
programs of all ranks fit together: every receive gets the message meant for it, and nothing
deadlocks even on NCCL, where a rank's batched transfers run one after another on one stream.

* **AFAB** (GPipe): m forwards, then m backwards; holds all m micro-batches' activations.
* **1F1B** (PipeDream-Flush, Megatron-LM §2.2): rank r runs ``p - r - 1`` warm-up forwards, then
  alternates one forward and one backward, then drains; at most ``p - r`` micro-batches in flight.
  Bubble (p-1)/(m+p-1) of the step, as AFAB's.
* **Interleaved 1F1B** (Megatron-LM 2021, §2.2.2): each rank holds ``v`` model chunks; chunk c of
  rank r is virtual stage ``c·p + r`` (Megatron's assignment), so a micro-batch visits every rank
  v times. Forwards go in groups of p micro-batches per chunk (chunk 0 of micro-batches 0..p-1,
  chunk 1 of the same, ...), hence ``m`` must be a multiple of ``p``. Warm-up
  ``2(p - r - 1) + (v - 1)p`` chunk-forwards. Bubble (p-1)/(v·m+p-1): v times less idle compute
  for v times more p2p messages.

Transfers: the activation out of virtual stage s goes to s + 1 (rank ``(r + 1) % p``: the last
rank hands chunk c's output to rank 0's chunk c + 1), its gradient comes back the same way. A
rank posts each send right after the compute that produced it. Receives are posted early where
that cannot stall NCCL's one in-order stream of batches (``pipeline_sim`` checks every program
of p <= 8, v <= 4, m <= 4p in ``tests/parallel/test_pipeline_interleaved.py``; simpler rules
deadlock there or lengthen the bubble):

* interleaved: the receive of a forward right after the previous forward, of a backward right
  after the previous backward (Megatron's ``overlap_p2p_comm`` placement), one batch per
  compute: the next forward's input travels while this rank runs a backward, and the other way;
* 1F1B and AFAB: a forward's input just before it; a backward's gradient right after the
  previous backward, in a batch of its own behind the one the next forward waits for, so the
  gradient travels during that forward.

``waits`` says which batches the executor completes before each compute; the simulator runs
exactly those waits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

PipelineSchedule = Literal["1f1b", "afab"]  # the type of ParallelDims.pipeline_schedule
SCHEDULES = get_args(PipelineSchedule)


@dataclass(frozen=True)
class Op:
    """``kind`` "F" or "B" of model chunk ``chunk`` on micro-batch ``mb``."""

    kind: str
    chunk: int
    mb: int


@dataclass(frozen=True)
class Msg:
    """One transfer, as this rank sees it. ``kind``: "A" (an activation, sent to the next virtual
    stage) or "G" (its gradient, sent to the previous). ``chunk``: this rank's chunk (the producer
    of a send, the consumer of a receive); ``peer``: the other pp rank; ``peer_chunk``: its chunk."""

    send: bool
    kind: str
    chunk: int
    mb: int
    peer: int
    peer_chunk: int

    def key(self) -> tuple[str, int, int]:
        """What travels, named by its consumer: (kind, receiving chunk, micro-batch)."""
        return (self.kind, self.peer_chunk if self.send else self.chunk, self.mb)


@dataclass(frozen=True)
class Batch:
    """Transfers posted together (one ``batch_isend_irecv``); the rank waits for one only when a
    compute needs a tensor it receives (and for all at the end)."""

    msgs: tuple[Msg, ...]


def check_schedule(schedule: str, pp: int, num_microbatches: int, virtual_stages: int = 1) -> None:
    """Raise ValueError naming the field and the fix; the same checks run before any collective."""
    if schedule not in SCHEDULES:
        raise ValueError(f"parallel.pipeline_schedule={schedule!r}: use one of {SCHEDULES}")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches!r}: must be >= 1 (training.global_batch_size / "
                         f"(micro_batch_size * dp))")
    v = virtual_stages
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"parallel.virtual_stages={v!r}: must be a positive integer (1: no interleaving)")
    if v > 1:
        if pp < 2:
            raise ValueError(f"parallel.virtual_stages={v} needs parallel.pp >= 2 (it interleaves model chunks "
                             f"over pipeline ranks); use virtual_stages=1 or pp >= 2")
        if schedule != "1f1b":
            raise ValueError(f"parallel.virtual_stages={v} is the interleaved 1F1B schedule; set "
                             f"parallel.pipeline_schedule=1f1b or virtual_stages=1")
        if num_microbatches % pp:
            raise ValueError(f"parallel.virtual_stages={v}: the number of micro-batches ({num_microbatches} = "
                             f"global_batch_size / (micro_batch_size * dp)) must be a multiple of parallel.pp={pp}; "
                             f"use a global batch of a multiple of {pp} micro-batches per DP rank")


def _interleaved_warmup(pp: int, rank: int, m: int, v: int) -> int:
    return min(2 * (pp - rank - 1) + (v - 1) * pp, m * v)


def compute_order(schedule: str, pp: int, rank: int, m: int, v: int = 1, forward_only: bool = False) -> list[Op]:
    """The forwards and backwards of ``rank``, in the order it runs them."""
    check_schedule(schedule, pp, m, v)
    if v == 1:
        fwd = [Op("F", 0, i) for i in range(m)]
        bwd = [Op("B", 0, i) for i in range(m)]
        warm = m if schedule == "afab" else min(pp - rank - 1, m)
    else:
        def group(k):  # k-th chunk-forward: chunk (k mod pv) // p, micro-batches in groups of p
            return (k % (pp * v)) // pp, (k // (pp * v)) * pp + k % pp
        fwd = [Op("F", *group(k)) for k in range(m * v)]
        bwd = [Op("B", v - 1 - group(k)[0], group(k)[1]) for k in range(m * v)]
        warm = _interleaved_warmup(pp, rank, m, v)
    if forward_only:
        return fwd
    steady = len(fwd) - warm
    order = fwd[:warm]
    for i in range(steady):
        order += [fwd[warm + i], bwd[i]]
    return order + bwd[steady:]


def _need(op: Op, pp: int, rank: int, v: int) -> Msg | None:
    """The receive ``op`` needs: a forward its input (none on virtual stage 0, which reads token
    ids), a backward its output's gradient (none on the last virtual stage, which has the loss)."""
    stage = op.chunk * pp + rank
    if op.kind == "F":
        if stage == 0:
            return None
        return Msg(False, "A", op.chunk, op.mb, (rank - 1) % pp, op.chunk - (rank == 0))
    if stage == pp * v - 1:
        return None
    return Msg(False, "G", op.chunk, op.mb, (rank + 1) % pp, op.chunk + (rank == pp - 1))


def _product(op: Op, pp: int, rank: int, v: int) -> Msg | None:
    """The send ``op`` produces: a forward's output, a backward's input gradient."""
    stage = op.chunk * pp + rank
    if op.kind == "F":
        if stage == pp * v - 1:
            return None
        return Msg(True, "A", op.chunk, op.mb, (rank + 1) % pp, op.chunk + (rank == pp - 1))
    if stage == 0:
        return None
    return Msg(True, "G", op.chunk, op.mb, (rank - 1) % pp, op.chunk - (rank == 0))


def program(schedule: str, pp: int, rank: int, m: int, v: int = 1, forward_only: bool = False) -> list:
    """``rank``'s list of ``Op`` and ``Batch`` (see the module docstring for where each transfer goes)."""
    order = compute_order(schedule, pp, rank, m, v, forward_only)
    after: dict[int, list] = {i: [] for i in range(-1, len(order))}  # -1: before the first compute
    last_of_kind: dict[str, int] = {}
    for j, op in enumerate(order):
        post = j - 1
        if op.kind in last_of_kind and (op.kind == "B" or v > 1):
            post = last_of_kind[op.kind]
        last_of_kind[op.kind] = j
        sent = _product(op, pp, rank, v)
        if sent is not None:
            after[j].append((sent, j))
        need = _need(op, pp, rank, v)
        if need is not None:
            after[post].append((need, j))
    prog: list = []
    for i in range(-1, len(order)):
        if i >= 0:
            prog.append(order[i])
        msgs = after[i]
        if v == 1:  # what the next compute needs first, what a later one needs in a batch of its own
            parts = [[x for x, j in msgs if x.send or j == i + 1], [x for x, j in msgs if not (x.send or j == i + 1)]]
        else:
            parts = [[x for x, _ in msgs]]
        prog += [Batch(tuple(part)) for part in parts if part]
    return prog


# what the schedules cost, in closed form ------------------------------------------------------
def bubble_fraction(schedule: str, pp: int, m: int, v: int = 1) -> float:
    """Idle fraction of a step with free communication: (p-1)/(m+p-1) for AFAB and 1F1B,
    (p-1)/(v·m+p-1) interleaved (Megatron-LM 2021, §2.2.2: the bubble shrinks v times)."""
    check_schedule(schedule, pp, m, v)
    return (pp - 1) / (v * m + pp - 1)


def microbatches_in_flight(schedule: str, pp_size: int, pp_rank: int, num_microbatches: int,
                           virtual_stages: int = 1) -> int:
    """Most forwards whose backward has not run yet on this rank: the activations it must hold.

    Counted in chunk-forwards (1/v of the rank's layers each): AFAB holds all m; 1F1B its
    warm-up forwards plus one, ``min(p - r, m)``; interleaved its warm-up plus one,
    ``min(2(p - r - 1) + (v - 1)p + 1, v·m)`` -- rank 0 about (1 + (p-1)/(p·v))·p micro-batches
    of the whole stage's layers; 1 without a pipeline, whatever the schedule. Activation
    checkpointing sizes its MD buffer with this.
    """
    m, v = num_microbatches, virtual_stages
    check_schedule(schedule, pp_size, m, v)
    if pp_size == 1:  # no pipeline: the step runs each micro-batch's forward and backward in turn
        return 1
    if schedule == "afab":
        return m
    if v == 1:
        return min(pp_size - pp_rank, m)
    return min(_interleaved_warmup(pp_size, pp_rank, m, v) + 1, m * v)


def waits(prog: list, release_sends: bool = True) -> list[int]:
    """For each compute of ``prog``, the batch (numbered in posting order) the executor completes,
    with every batch before it, before it runs the compute; -1: none.

    It is the latest of: the batch holding the compute's own receive; the batches posted before
    the previous compute (a send is only known done once waited for -- gloo cannot tell -- and its
    buffer lives until then); with ``release_sends``, a batch posted just before this compute
    that sends an activation, so a sent output's storage goes before the next one is made."""
    out, recv_at, n_batches, posted_before = [], {}, 0, []  # posted_before[i]: batches before compute i
    for x in prog:
        if isinstance(x, Batch):
            for msg in x.msgs:
                if not msg.send:
                    recv_at[msg.key()] = n_batches
            n_batches += 1
            continue
        posted_before.append(n_batches)
    i, n, last_activation_send = 0, 0, -1
    for x in prog:
        if isinstance(x, Batch):
            if any(msg.send and msg.kind == "A" for msg in x.msgs):
                last_activation_send = n
            n += 1
            continue
        need = recv_at.get(("A" if x.kind == "F" else "G", x.chunk, x.mb), -1)
        lagged = posted_before[i - 1] - 1 if i else -1
        sent = last_activation_send if release_sends else -1
        out.append(max(need, lagged, sent))
        i += 1
    return out
