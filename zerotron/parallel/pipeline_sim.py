"""Run the pipeline programs of every rank on paper: do they fit together, and how long do they take?

A GPU's batched p2p is what makes a schedule hard to get right, and this project's tests run on
gloo, which forgives more. So ``simulate`` models the strict machine, NCCL's:

* each rank has a compute queue (its ``Op`` in program order) and a communication queue (its
  ``Batch`` in program order, one after another: a ``batch_isend_irecv`` is one NCCL group on
  the pipeline group's one stream);
* a batch starts when it is at the head of its queue and every compute posted before it has
  finished (the stream waits for the tensors it sends);
* a send and its receive complete together, only once both are in started batches (a
  rendezvous: no buffering assumed), matched per (sender, receiver) pair in posting order, as
  NCCL and gloo match them; a batch completes when all its transfers have;
* a compute starts when the previous one has finished and the batch holding its receive has
  completed.

Breaking any of this -- a receive handed another message's tensor (same shape: silently wrong
data), a transfer never matched, a deadlock, a backward before its forward -- raises
``ScheduleError``. Gloo starts the transfers of later batches without waiting for earlier ones,
so a program that passes here also runs there.

Times: ``t_forward`` / ``t_backward`` per chunk compute, transfers free. The per-rank idle
fraction is then the schedule's bubble by event-driven count, which the closed forms of
``pipeline_schedules.bubble_fraction`` are checked against.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from zerotron.parallel.pipeline_schedules import Batch, Op, waits


class ScheduleError(RuntimeError):
    """The programs of the ranks do not fit together."""


@dataclass
class SimResult:
    makespan: float
    busy: list[float]  # compute time per rank
    peak_in_flight: list[int]  # most chunk-forwards alive (forward run, backward not yet) per rank

    def idle(self, rank: int) -> float:
        return 1 - self.busy[rank] / self.makespan


def _check_matching(batches: list[list[Batch]]) -> dict:
    """Per (sender, receiver), the n-th send must carry what the n-th receive expects.
    Returns {(rank, batch, i): transfer id} with ids shared by both ends."""
    sends, recvs = defaultdict(list), defaultdict(list)
    ids = {}
    for r, bs in enumerate(batches):
        for b, batch in enumerate(bs):
            for i, msg in enumerate(batch.msgs):
                if msg.peer == r:
                    raise ScheduleError(f"rank {r} sends to itself: {msg}")
                pair = (r, msg.peer) if msg.send else (msg.peer, r)
                side = sends if msg.send else recvs
                ids[(r, b, i)] = (pair, len(side[pair]))
                side[pair].append(msg.key())
    for pair in set(sends) | set(recvs):
        if sends.get(pair, []) != recvs.get(pair, []):
            raise ScheduleError(f"rank {pair[0]} -> {pair[1]}: sends {sends.get(pair, [])} but the receiver "
                                f"expects {recvs.get(pair, [])}, in that order")
    return ids


def simulate(programs: list[list], t_forward: float = 1.0, t_backward: float = 2.0,
             release_sends: bool = True) -> SimResult:
    """``programs[r]``: rank r's list of ``Op`` / ``Batch`` (``pipeline_schedules.program``); each
    compute first completes the batches the executor completes (``pipeline_schedules.waits``)."""
    p = len(programs)
    ops = [[x for x in prog if isinstance(x, Op)] for prog in programs]
    batches = [[x for x in prog if isinstance(x, Batch)] for prog in programs]
    ids = _check_matching(batches)
    waits_of = [waits(prog, release_sends) for prog in programs]
    before = [[] for _ in range(p)]  # computes posted before each batch
    recv_in = [dict() for _ in range(p)]  # (kind, chunk, mb) -> batch holding that receive
    for r, prog in enumerate(programs):
        n = 0
        for x in prog:
            if isinstance(x, Op):
                n += 1
                continue
            before[r].append(n)
            for msg in x.msgs:
                if not msg.send:
                    if msg.key() in recv_in[r]:
                        raise ScheduleError(f"rank {r} receives {msg.key()} twice")
                    recv_in[r][msg.key()] = len(before[r]) - 1
    op_end = [[None] * len(o) for o in ops]
    b_start = [[None] * len(b) for b in batches]
    b_end = [[None] * len(b) for b in batches]
    left = [[len(bt.msgs) for bt in b] for b in batches]
    ends, matched = defaultdict(list), {}  # transfer id -> [(rank, batch)], time matched
    head, nxt = [0] * p, [0] * p
    alive, in_flight, peak = [set() for _ in range(p)], [0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while head[r] < len(batches[r]):  # the communication queue
                b = head[r]
                if b_start[r][b] is None:
                    k = before[r][b]
                    if nxt[r] < k:
                        break
                    b_start[r][b] = max(b_end[r][b - 1] if b else 0.0, op_end[r][k - 1] if k else 0.0)
                    for i in range(len(batches[r][b].msgs)):
                        tid = ids[(r, b, i)]
                        ends[tid].append((r, b))
                        if len(ends[tid]) == 2:
                            matched[tid] = max(b_start[rr][bb] for rr, bb in ends[tid])
                            for rr, bb in ends[tid]:
                                left[rr][bb] -= 1
                    progress = True
                if left[r][b]:
                    break
                times = [matched[ids[(r, b, i)]] for i in range(len(batches[r][b].msgs))]
                b_end[r][b] = max([b_start[r][b], *times])
                head[r] += 1
                progress = True
            while nxt[r] < len(ops[r]):  # the compute queue
                i, op = nxt[r], ops[r][nxt[r]]
                b = recv_in[r].get(("A" if op.kind == "F" else "G", op.chunk, op.mb))
                if b is not None and waits_of[r][i] < b:
                    raise ScheduleError(f"rank {r}: {op} would run before its receive completes")
                b = waits_of[r][i] if waits_of[r][i] >= 0 else None
                if b is not None and b_end[r][b] is None:
                    break
                if op.kind == "B":
                    if (op.chunk, op.mb) not in alive[r]:
                        raise ScheduleError(f"rank {r}: backward {op} without its forward before it")
                    alive[r].discard((op.chunk, op.mb))
                    in_flight[r] -= 1
                else:
                    alive[r].add((op.chunk, op.mb))
                    in_flight[r] += 1
                    peak[r] = max(peak[r], in_flight[r])
                start = max(op_end[r][i - 1] if i else 0.0, b_end[r][b] if b is not None else 0.0)
                op_end[r][i] = start + (t_forward if op.kind == "F" else t_backward)
                nxt[r] += 1
                progress = True
    stuck = {r: (ops[r][nxt[r]] if nxt[r] < len(ops[r]) else "done",
                 batches[r][head[r]] if head[r] < len(batches[r]) else "done")
             for r in range(p) if nxt[r] < len(ops[r]) or head[r] < len(batches[r])}
    if stuck:
        raise ScheduleError(f"deadlock: rank -> (next compute, head batch) {stuck}")
    makespan = max([t for row in op_end + b_end for t in row] or [0.0])
    busy = [sum(t_forward if op.kind == "F" else t_backward for op in o) for o in ops]
    return SimResult(makespan, busy, peak)
