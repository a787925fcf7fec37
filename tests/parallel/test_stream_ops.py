"""The watchdog's view of synchronous NCCL collectives costs no CUDA event per collective.

Issue 41, item 8: ``Health.issued`` recorded an event after every synchronous collective on a
CUDA tensor (thousands a step for a large model's TP all-reduces). Now the op joins its stream's
FIFO and the checking thread records one marker per check behind what is queued
(``parallel/stream_ops.py``). A CPU machine has no CUDA, so the stream and the events are stood
in for: each fake event records which stream it was put on and completes when told.
"""

from __future__ import annotations

import types

import torch

from zerotron.parallel import host_sync, stream_ops
from zerotron.parallel.health import Health


class FakeEvent:
    made: list = []

    def __init__(self):
        self.stream, self.passed = None, False
        FakeEvent.made.append(self)

    def record(self, stream=None):
        self.stream = stream

    def query(self):
        return self.passed


def test_synchronous_cuda_collectives_share_one_marker_per_check(monkeypatch):
    FakeEvent.made = []
    monkeypatch.setattr(host_sync, "event", lambda enable_timing=False: FakeEvent())
    monkeypatch.setattr(stream_ops, "current_stream", lambda device: "stream-0")
    h = Health(0, 1, timeout_s=60)  # one rank: no heartbeat thread, the test is the checker
    group = types.SimpleNamespace(name="tp", ranks=[0, 1], size=2)
    cuda = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), shape=(8,),
                                 dtype=torch.bfloat16)

    def collectives(n):
        for _ in range(n):
            h.before("all_reduce", group, cuda)
            h.issued(None, cuda)  # synchronous: no work, done when the stream passes it

    collectives(1000)
    assert FakeEvent.made == []  # the hot path records nothing
    with h._lock:
        assert len(h._pending()) == 1000
    assert len(FakeEvent.made) == 1  # one marker, behind all of them
    assert FakeEvent.made[0].stream == "stream-0"
    collectives(10)
    with h._lock:
        assert len(h._pending()) == 1010 and len(FakeEvent.made) == 1  # the marker is still out
    FakeEvent.made[0].passed = True  # the stream has run the first 1000
    with h._lock:
        assert len(h._pending()) == 10 and len(FakeEvent.made) == 2  # a new marker behind the 10
    FakeEvent.made[1].passed = True
    with h._lock:
        assert h._pending() == [] and len(FakeEvent.made) == 2  # nothing queued: no event
    assert h._inflight == {}
