"""Which synchronous NCCL collectives a CUDA stream has passed, told by one event per check.

A synchronous NCCL call returns to the host at once and runs when its stream reaches it, so the
health watchdog (``health.py``) must ask the stream whether an op is done. An event recorded
after every collective answers that, at a driver call per collective: thousands a step for the
TP all-reduces of a large model, on the hot path. A verdict needs far less: an op matters only
once it has waited for most of the collective timeout. So the ops go into a per-stream FIFO in
issue order (O(1) each), and the checking thread (heartbeat or watchdog, about once a second)
records one marker event on the stream behind the ops queued so far; once the stream has passed
it, all those ops are done (a stream runs its work in order) and leave the FIFO, each once:
amortised O(1) per op, and at most one event per stream per check, none on a stream that has
nothing queued. An op is thus seen done up to one check late, nothing beside a timeout of
minutes.
"""

from __future__ import annotations

from collections import deque

import torch

from zerotron.parallel import host_sync


def current_stream(device: torch.device):
    """The stream a synchronous collective on ``device`` is queued on (the caller's current one)."""
    return torch.cuda.current_stream(device)


class StreamOps:
    """The synchronous ops queued on one CUDA stream, oldest first, and the marker behind a
    prefix."""

    def __init__(self, stream):
        self.stream = stream
        self.ops: deque = deque()
        self.marker = None  # (event, how many of the oldest ops it follows)

    def add(self, op) -> None:
        self.ops.append(op)

    def settle(self) -> None:
        """Drop the ops the stream has passed; behind the rest, record a marker if none is out.
        Called under the health lock, from the checking thread (not per collective)."""
        if self.marker is not None and self.marker[0].query():
            for _ in range(self.marker[1]):
                self.ops.popleft()
            self.marker = None
        if self.marker is None and self.ops:
            event = host_sync.event()
            if event is None:  # a dry run: no driver, nothing is ever in flight on a stream
                self.ops.clear()
                return
            event.record(self.stream)
            self.marker = (event, len(self.ops))


class StreamQueues:
    """``StreamOps`` per stream (keyed by the stream itself, which hashes by its handle)."""

    def __init__(self):
        self.by_stream: dict = {}

    def add(self, op, device: torch.device) -> None:
        stream = current_stream(device)
        queue = self.by_stream.get(stream)
        if queue is None:
            queue = self.by_stream[stream] = StreamOps(stream)
        queue.add(op)

    def queued(self) -> list:
        """Every op still queued, without asking the streams (after a failure: which op was it)."""
        return [op for queue in self.by_stream.values() for op in queue.ops]

    def pending(self) -> list:
        """Every op not yet known to be passed, after settling each stream."""
        out = []
        for queue in self.by_stream.values():
            queue.settle()
            out.extend(queue.ops)
        return out
