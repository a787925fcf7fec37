"""No silent hangs: name the dead or stuck rank, and (debug mode) catch diverging collectives.

Four mechanisms, all owned by the ``Grid`` and used by every collective and p2p transfer:

* **Sequence numbers and call sites.** Each rank counts its collectives per group (its p2p
  transfers per pair of ranks) and remembers the last one (op, group, number, shape, dtype) and
  which of them are still in flight. Its call site (the first frame outside ``zerotron/parallel``)
  is added in debug mode only: walking the stack on every collective costs microseconds a TP
  all-reduce on NVLink does not have.
* **Heartbeats.** A daemon thread publishes ``(time, counts, in-flight ops, last collective,
  verdict)`` to the rendezvous store every ``heartbeat_s``. When a collective fails -- gloo
  raises at once when a peer process dies and after the group's timeout when a peer is stuck --
  ``diagnose`` reads the heartbeats (``blame.py``) and names the culprit: *dead or frozen*
  (heartbeat stopped) or *stuck* (alive but behind in the sequence). A peer that is behind because it waits for a
  third rank (rank 2 waits for rank 0 on DP, rank 0 for rank 1 on TP) is followed to that rank,
  so every survivor names the same root; a rank that gave up first leaves its verdict behind.
* **Watchdog.** With a timeout, a second thread diagnoses any op in flight for longer than the
  timeout less ``lead_s`` and prints the verdict. NCCL aborts at the timeout without unwinding
  to Python and no NCCL ``wait()`` raises, so under NCCL (or ``ZEROTRON_EMULATE_NCCL=1``) the
  watchdog prints the survivor's ``CollectiveError`` line and exits 3 itself once a culprit is
  named; on gloo the exception reuses the verdict. So does a SIGTERM while an op waits on a
  dead or frozen rank (``signal_wakeup.py``): torchrun's SIGKILL comes 30 s later.
* **Sequence check** (``ZEROTRON_DEBUG_COLLECTIVES=1``): before every collective the group
  all-gathers a fixed-size descriptor (op, group, shape, dtype, call site) and every rank
  compares; the first divergence raises on all ranks with both ranks' call sites -- the usual
  cause of a hang (one rank skipped or reordered a collective) reported before it hangs.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zerotron.parallel import host_sync
from zerotron.parallel.blame import blame
from zerotron.parallel.runtime import collective_device, nccl_semantics, serves
from zerotron.parallel.signal_wakeup import SignalWakeup
from zerotron.parallel.stream_ops import StreamQueues

DESCRIPTOR_BYTES = 512
EXIT_COLLECTIVE_FAILED = 3  # scripts/pretrain_gpt.py's exit status for a dead or stuck peer
_PARALLEL_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


class CollectiveError(RuntimeError):
    """A collective failed or would diverge; the message names the rank(s) responsible."""


def _require_served(group, device: torch.device, what: str) -> None:
    if not serves(group.pg, device):
        raise CollectiveError(f"{what} on group {group.name}: its backend does not serve "
                              f"{device.type} tensors (NCCL has no CPU one): move it to the device")


def _inside(filename: str) -> bool:
    path = os.path.abspath(filename)
    return os.path.dirname(path) == _PARALLEL_DIR or path.startswith(_TORCH_DIR)


def call_site() -> str:
    """``file:line in function`` of the first caller outside zerotron/parallel and torch (a TP
    all-reduce runs inside ``autograd.Function.apply``; the model line that called it is news)."""
    frame = sys._getframe(1)
    while frame is not None and _inside(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{os.path.relpath(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


@dataclass(eq=False)
class _Op:
    """One launch (a collective, or a batch of p2p transfers) from ``before`` until it completes.

    ``links`` are ``(counter key, member ranks, sequence number)``: whom it waits for. ``probe``
    tells completion: None while the issuing call still blocks, else a torch Work (or a list of
    them); a synchronous NCCL call's op waits in its stream's queue instead (``stream_ops.py``)."""

    links: list = field(default_factory=list)
    desc: str = ""
    t0: float = field(default_factory=time.monotonic)
    probe: object = None
    verdict: tuple | None = None  # (culprit text, blamed ranks), once diagnosed
    failed: bool = False  # kept in the heartbeat after its error: peers follow the chain through it
    reported: bool = False  # the watchdog has printed its verdict

    def done(self) -> bool:
        if self.probe is None or self.failed:
            return False
        try:
            works = self.probe if isinstance(self.probe, list) else [self.probe]
            return all(w.is_completed() for w in works)
        except Exception:  # noqa: BLE001 - a failed work is the waiting thread's to report
            return True


class Health:
    def __init__(self, rank: int, world_size: int, heartbeat_s: float = 1.0, check_sequence: bool | None = None,
                 timeout_s: float | None = None, lead_s: float | None = None):
        self.rank, self.world_size, self.heartbeat_s = rank, world_size, heartbeat_s
        debug = os.environ.get("ZEROTRON_DEBUG_COLLECTIVES", "") not in ("", "0")
        self.check_sequence = debug if check_sequence is None else check_sequence
        self.exit_on_verdict = nccl_semantics()  # no exception will come (see ``_watch``)
        self.timeout_s = timeout_s
        # Diagnosing takes ~2.5 heartbeats: start 10 s before the timeout fires (less for short
        # timeouts, never less than the diagnosis needs unless that is most of the timeout).
        self.lead_s = lead_s if lead_s is not None else (
            min(max(3 * heartbeat_s + 1, min(10.0, timeout_s / 2)), 0.75 * timeout_s) if timeout_s else 0.0)
        self.counts: dict[str, int] = {}
        self.last = ""
        self.verdict: dict | None = None
        self._lock, self._diagnosing = threading.Lock(), threading.Lock()
        self._current: _Op | None = None
        self._inflight: dict[int, _Op] = {}  # by id(probe), id(op) before it has one: O(1) in, out
        self._on_streams = StreamQueues()  # synchronous CUDA ops, told done by one event per check
        self._prune_at = 256
        self._verdict_op: _Op | None = None  # the op whose diagnosis ``verdict`` publishes
        self._store = self._default_store()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        if self._store is not None and world_size > 1 and not host_sync.simulated():  # no peers to watch
            self._publish()  # at once: a rank that dies in its first second is still "seen alive once"
            self._wakeup = SignalWakeup.shared()  # here: only the main thread may take it
            loops = [("heartbeat", self._beat)] + ([("watchdog", self._watch)] if timeout_s else [])
            for name, loop in loops:
                t = threading.Thread(target=loop, name=f"zerotron-{name}", daemon=True)
                t.start()
                self._threads.append(t)

    @property
    def _thread(self):
        return self._threads[0] if self._threads else None

    @staticmethod
    def _default_store():
        try:
            return dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - private API; without a store we still raise, just less precisely
            return None

    def _read(self, member: int) -> dict | None:
        key = f"zerotron/heartbeat/{member}"
        try:  # check first: a get of a missing key would block for the store's (long) timeout
            return json.loads(self._store.get(key)) if self._store.check([key]) else None
        except Exception:  # noqa: BLE001 - store gone
            return None

    def _publish(self) -> None:
        with self._lock:
            inflight = [link for op in self._pending() for link in op.links]
        payload = json.dumps({"t": time.time(), "counts": dict(self.counts), "last": self.last,
                              "inflight": inflight, "verdict": self.verdict})
        self._store.set(f"zerotron/heartbeat/{self.rank}", payload)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._publish()
            except Exception:  # noqa: BLE001 - the store went away: the job is ending
                return

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2 * self.heartbeat_s)

    # per collective ------------------------------------------------------------------------------
    def before(self, op: str, group, tensor: torch.Tensor | None, peer: int | None = None) -> None:
        """Count this collective (p2p: this transfer to/from ``peer``) and mark it in flight; in
        debug mode verify every rank of ``group`` issues the same one."""
        key, members = group.name, tuple(group.ranks)
        if peer is not None:  # sends and receives pair up per link, not per group
            members = tuple(sorted((self.rank, peer)))
            key = f"{group.name}:{members[0]}-{members[1]}"
        if tensor is not None and host_sync.simulated():  # NCCL refuses it; fake tensors do not
            _require_served(group, tensor.device, op)
        self.counts[key] = self.counts.get(key, 0) + 1
        shape = tuple(tensor.shape) if tensor is not None else ()
        dtype = str(tensor.dtype).replace("torch.", "") if tensor is not None else "-"
        self.last = f"{op} on {key} #{self.counts[key]} shape={shape} dtype={dtype}"
        if self.check_sequence:
            site = call_site()
            self.last += f" at {site}"
        with self._lock:
            if self._current is None:
                self._current = _Op()
                self._inflight[id(self._current)] = self._current
            self._current.links.append((key, members, self.counts[key]))
            self._current.desc = self.last
        if self.check_sequence and group.size > 1 and op not in ("send", "recv"):  # p2p is not group-wide
            self._check(op, group, shape, dtype, site, tensor)

    def issued(self, work=None, tensor: torch.Tensor | None = None) -> None:
        """The launch since ``before`` returned: ``work`` (async; a list for a p2p batch) is in
        flight until it completes; a synchronous call is done, except on CUDA, where it is done
        when the stream passes it (its stream's queue: ``stream_ops.py``, no event of its own)."""
        with self._lock:
            op, self._current = self._current, None
            if op is None:
                return
            del self._inflight[id(op)]
            if work is not None:
                op.probe = work
                self._inflight[id(work)] = op
            elif tensor is not None and tensor.is_cuda and self.timeout_s and not host_sync.simulated():
                self._on_streams.add(op, tensor.device)
            if len(self._inflight) > self._prune_at:  # without a heartbeat thread nobody prunes
                self._pending()  # O(n): next time only once the list has doubled (amortized O(1))
                self._prune_at = max(256, 2 * len(self._inflight))

    def completed(self, probe) -> None:
        """The issuing code has waited for ``probe`` (the work, or list of works, given to ``issued``):
        forget its op now, not at the next prune -- a torch Work keeps its tensors alive, and a
        pipeline's sent outputs and received activations must go when they are done with."""
        with self._lock:
            self._inflight.pop(id(probe), None)

    def _pending(self) -> list[_Op]:
        """Ops still in flight, oldest first; completed ones are dropped (call under the lock),
        and a published verdict with them: its op finished after all, so it blamed nobody."""
        self._inflight = {key: op for key, op in self._inflight.items() if not op.done()}
        live = list(self._inflight.values()) + self._on_streams.pending()
        vop = self._verdict_op
        if vop is not None and not vop.failed and vop not in live:
            self._verdict_op = self.verdict = None
        return sorted(live, key=lambda op: op.t0)

    def _check(self, op, group, shape, dtype, site, tensor) -> None:
        signature = f"{op}|{group.name}|{shape}|{dtype}"
        raw = f"{signature}\n{site}".encode()[:DESCRIPTOR_BYTES]
        mine = torch.zeros(DESCRIPTOR_BYTES, dtype=torch.uint8)
        mine[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        # beside the collective's tensor, or where the group takes tensors (a barrier has none)
        device = tensor.device if tensor is not None else collective_device(group.pg)
        if host_sync.simulated():
            _require_served(group, device, f"{op}'s debug descriptor")
        everyone = torch.empty(DESCRIPTOR_BYTES * group.size, dtype=torch.uint8, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(everyone, mine.to(device), group=group.pg)
        rows = host_sync.read(everyone.view(group.size, -1), "debug_collectives", placeholder=None)
        if rows is None:  # a dry run: the gather is issued, but there are no peers' descriptors
            return
        texts = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in rows]
        for member, text in zip(group.ranks, texts):
            their_sig, _, their_site = text.partition("\n")
            if their_sig != signature:
                raise CollectiveError(
                    f"collectives diverged on group {group.name} at its collective #{self.counts[group.name]}: "
                    f"rank {self.rank} calls {signature} at {site}, but rank {member} calls {their_sig} at "
                    f"{their_site}")

    def _watch(self) -> None:
        """Diagnose (once) every op in flight past ``timeout_s - lead_s``; print the verdict. Under
        NCCL semantics no error reaches the waiting thread (a CUDA sync, where no signal handler
        runs either): exit 3 once a culprit is named, or at the timeout whatever the verdict."""
        while not self._stop.is_set():
            terminating = self._wakeup.wait(min(0.5, self.heartbeat_s))  # SIGTERM, ever
            hold_s = 3 * self.heartbeat_s if terminating else self.timeout_s - self.lead_s
            with self._lock:  # on SIGTERM: any op older than a heartbeat's staleness
                due = time.monotonic() - hold_s
                late = [op for op in self._pending() if op.t0 <= due
                        and (op.verdict is None or self.exit_on_verdict or terminating)]
            for op in late[:1]:
                waited = time.monotonic() - op.t0
                if op.verdict is not None and terminating and not op.verdict[1]:
                    op.verdict = None  # nobody was named then: ask again now
                if op.verdict is None:
                    try:
                        text, _ = self._verdict_of(op)
                    except Exception:  # noqa: BLE001 - the store went away: the job is ending
                        return
                    if not op.reported:
                        op.reported = True
                        print(f"[rank {self.rank}] zerotron watchdog: {op.desc} has waited "
                              f"{waited:.0f}s of the {self.timeout_s:.0f}s collective timeout: "
                              f"{text}", file=sys.stderr, flush=True)
                if terminating and "dead or frozen" in op.verdict[0]:
                    self._exit(op, waited, "and this job is being stopped (SIGTERM)")
                if self.exit_on_verdict:
                    if op.verdict[1] or waited >= self.timeout_s:
                        self._exit(op, waited, "and no error reaches the waiting thread under NCCL")
                    op.verdict = None  # nobody named yet (no stale heartbeat yet): ask again

    def _exit(self, op: _Op, waited: float, why: str) -> None:
        """The line a survivor's ``CollectiveError`` would print (drills read it), then exit 3."""
        print(f"[rank {self.rank}] CollectiveError: rank {self.rank}: {op.desc} has waited "
              f"{waited:.0f}s {why}: {op.verdict[0]}. Exiting (3) from the health watchdog",
              file=sys.stderr, flush=True)
        os._exit(EXIT_COLLECTIVE_FAILED)  # the run lock left behind is taken over as stale

    # after a failure -----------------------------------------------------------------------------
    def _failed_op(self, op: str, group) -> tuple[_Op, str]:
        """The op a failure on ``group`` belongs to, marked failed (kept in flight), and where."""
        key = group.name
        with self._lock:  # the oldest op on the group: the one waited for (async ones complete in order)
            candidates = [*([self._current] if self._current else []), *self._inflight.values(),
                          *self._on_streams.queued()]
        ours = lambda o: [(k, n) for k, _, n in o.links if k == key or k.startswith(key + ":")]  # noqa: E731
        failed = next((o for o in candidates if ours(o)), None)
        if failed is None:
            failed = _Op([(key, tuple(group.ranks), self.counts.get(key, 0))])
            with self._lock:
                self._inflight[id(failed)] = failed
        seqs = ", ".join(f"its collective #{n}" if k == key else f"transfer {k} #{n}" for k, n in ours(failed))
        where = f"{op} on group {key} ({seqs}) at {call_site()}"
        failed.desc, failed.failed = failed.desc or where, True
        return failed, where

    def hold(self, op: str, group) -> None:
        """NCCL semantics: the failure is not raised; the op stays in flight for ``_watch``."""
        self._failed_op(op, group)

    def diagnose(self, op: str, group, exc: BaseException) -> CollectiveError:
        """Explain a failed collective by reading the other ranks' heartbeats."""
        failed, where = self._failed_op(op, group)
        culprit = "no peer to ask (no rendezvous store)"
        if self._store is not None:
            culprit, _ = self._verdict_of(failed)
        return CollectiveError(f"rank {self.rank}: {where} failed: {culprit}. Underlying error: "
                               f"{type(exc).__name__}: {str(exc).strip()[:300]}")

    def _verdict_of(self, op: _Op) -> tuple[str, list[int]]:
        """The culprit of ``op``'s wait, computed once (watchdog or failure, whichever is first)
        and published, so that ranks waiting on this one name the same root."""
        with self._diagnosing:
            if op.verdict is None:
                findings = self._blame(op.links)
                text = "; ".join(dict.fromkeys(t for _, t in findings)) or \
                    "no peer looks dead or behind (a network fault?)"
                op.verdict = (text, sorted({r for r, _ in findings}))
                if op.verdict[1]:
                    with self._lock:
                        self.verdict, self._verdict_op = {"blame": op.verdict[1], "text": text}, op
                    try:
                        self._publish()
                    except Exception:  # noqa: BLE001 - store gone: nobody left to tell
                        pass
            return op.verdict

    def _blame(self, links: list) -> list[tuple[int, str]]:
        return blame(self._read, self.rank, links, self.heartbeat_s)

