"""No silent hangs: name the dead or stuck rank, and (debug mode) catch diverging collectives.

Three mechanisms, all owned by the ``Grid`` and used by every collective:

* **Sequence numbers and call sites.** Each rank counts its collectives per group and remembers
  the last one's call site (the first frame outside ``zerotron/parallel``).
* **Heartbeats.** A daemon thread publishes ``(time, per-group counts, last call site)`` to the
  rendezvous store every ``heartbeat_s``. When a collective fails -- gloo raises at once when a
  peer process dies and after the collective timeout when a peer is stuck -- ``diagnose`` reads
  the peers' heartbeats and names the culprit: *dead* (heartbeat stale) or *stuck* (alive but
  behind in this group's sequence, with the call site where it is).
* **Sequence check** (``ZEROTRON_DEBUG_COLLECTIVES=1``): before every collective the group
  all-gathers a fixed-size descriptor (op, group, shape, dtype, call site) and every rank
  compares; the first divergence raises on all ranks with both ranks' call sites -- the usual
  cause of a hang (one rank skipped or reordered a collective) reported before it hangs.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

DESCRIPTOR_BYTES = 512
_PARALLEL_DIR = os.path.dirname(os.path.abspath(__file__))


class CollectiveError(RuntimeError):
    """A collective failed or would diverge; the message names the rank(s) responsible."""


def call_site() -> str:
    """``file:line in function`` of the first caller outside zerotron/parallel."""
    frame = sys._getframe(1)
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _PARALLEL_DIR:
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{os.path.relpath(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


class Health:
    def __init__(self, rank: int, world_size: int, heartbeat_s: float = 1.0, check_sequence: bool | None = None):
        self.rank, self.world_size, self.heartbeat_s = rank, world_size, heartbeat_s
        if check_sequence is None:
            check_sequence = os.environ.get("ZEROTRON_DEBUG_COLLECTIVES", "") not in ("", "0")
        self.check_sequence = check_sequence
        self.counts: dict[str, int] = {}
        self.last = ""
        self._store = self._default_store()
        self._stop = threading.Event()
        self._thread = None
        if self._store is not None and world_size > 1:
            self._publish()  # at once: a rank that dies in its first second is still "seen alive once"
            self._thread = threading.Thread(target=self._beat, name="zerotron-heartbeat", daemon=True)
            self._thread.start()

    @staticmethod
    def _default_store():
        try:
            return dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - private API; without a store we still raise, just less precisely
            return None

    def _read(self, member: int) -> dict | None:
        try:
            return json.loads(self._store.get(f"zerotron/heartbeat/{member}"))
        except Exception:  # noqa: BLE001 - missing key or store gone
            return None

    def _publish(self) -> None:
        payload = json.dumps({"t": time.time(), "counts": dict(self.counts), "last": self.last})
        self._store.set(f"zerotron/heartbeat/{self.rank}", payload)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._publish()
            except Exception:  # noqa: BLE001 - the store went away: the job is ending
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.heartbeat_s)

    # per collective ------------------------------------------------------------------------------
    def before(self, op: str, group, tensor: torch.Tensor | None) -> None:
        """Count this collective; in debug mode verify every rank of ``group`` issues the same one."""
        self.counts[group.name] = self.counts.get(group.name, 0) + 1
        site = call_site()
        shape = tuple(tensor.shape) if tensor is not None else ()
        dtype = str(tensor.dtype).replace("torch.", "") if tensor is not None else "-"
        self.last = f"{op} on {group.name} #{self.counts[group.name]} shape={shape} dtype={dtype} at {site}"
        if self.check_sequence and group.size > 1 and op not in ("send", "recv"):  # p2p is not group-wide
            self._check(op, group, shape, dtype, site, tensor)

    def _check(self, op, group, shape, dtype, site, tensor) -> None:
        signature = f"{op}|{group.name}|{shape}|{dtype}"
        raw = f"{signature}\n{site}".encode()[:DESCRIPTOR_BYTES]
        mine = torch.zeros(DESCRIPTOR_BYTES, dtype=torch.uint8)
        mine[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        device = tensor.device if tensor is not None and tensor.device.type == "cuda" else torch.device("cpu")
        everyone = torch.empty(DESCRIPTOR_BYTES * group.size, dtype=torch.uint8, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(everyone, mine.to(device), group=group.pg)
        texts = [bytes(c.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for c in everyone.chunk(group.size)]
        for member, text in zip(group.ranks, texts):
            their_sig, _, their_site = text.partition("\n")
            if their_sig != signature:
                raise CollectiveError(
                    f"collectives diverged on group {group.name} at its collective #{self.counts[group.name]}: "
                    f"rank {self.rank} calls {signature} at {site}, but rank {member} calls {their_sig} at "
                    f"{their_site}")

    # after a failure -----------------------------------------------------------------------------
    def diagnose(self, op: str, group, exc: BaseException) -> CollectiveError:
        """Explain a failed collective by reading the other ranks' heartbeats."""
        where = f"{op} on group {group.name} (its collective #{self.counts.get(group.name, 0)}) at {call_site()}"
        findings = []
        if self._store is not None:
            try:
                self._store.set_timeout(datetime.timedelta(seconds=2))
            except Exception:  # noqa: BLE001
                pass
            peers = [m for m in group.ranks if m != self.rank]
            first = {m: self._read(m) for m in peers}
            time.sleep(2.5 * self.heartbeat_s)  # a live rank's heartbeat moves on in the meantime
            for member in peers:
                beat, later = first[member], self._read(member)
                if beat is None and later is None:
                    findings.append(f"rank {member} has no readable heartbeat (it died before publishing one, "
                                    f"or the launcher's store is gone because a worker died)")
                elif later is None or later["t"] == beat["t"]:
                    last = (later or beat)["last"] or "no collective yet"
                    findings.append(f"rank {member} is dead or frozen (its heartbeat stopped; last: {last})")
                elif later["counts"].get(group.name, 0) < self.counts.get(group.name, 0):
                    findings.append(f"rank {member} is alive but stuck behind: it is at {later['last'] or 'start-up'}")
        culprit = "; ".join(findings) if findings else "no peer looks dead or behind (a network fault?)"
        return CollectiveError(f"rank {self.rank}: {where} failed: {culprit}. Underlying error: "
                               f"{type(exc).__name__}: {str(exc).strip()[:300]}")
