"""Pa+cpu's host pieces at the size the caching host allocator gives them (issue 41, item 5).

On CUDA each pinned block is rounded up to a power of two, so a checkpoint of 1.1 GiB holds
2 GiB of host RAM; the store's report must show the held bytes, and the pieces must be allocated
pinned, never pinned from a pageable copy (``t.pin_memory()`` allocates the tensor twice).
Pinning needs a GPU, so here ``host_sync.pinned``/``_is_pinned`` are stood in for and
``torch.empty(..., pin_memory=True)`` is recorded instead of performed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from zerotron.activation.config import ActivationCheckpointConfig
from zerotron.activation.store import CheckpointStore
from zerotron.parallel import host_sync


def block(nbytes: int) -> int:  # the allocator's block, computed here independently of host_sync
    size = 1
    while size < nbytes:
        size *= 2
    return size


@pytest.fixture
def pinned_host(monkeypatch):
    """A CPU machine made to look like a CUDA one to the store: pieces ask to be pinned, and the
    pinned-ness check sees them as pinned; ``asked`` records each host allocation's pin flag."""
    asked, empty = [], torch.empty

    def recording_empty(*size, pin_memory=False, **kwargs):
        asked.append(pin_memory)
        return empty(*size, **kwargs)

    def no_pageable_copy(self, *args, **kwargs):
        raise AssertionError("pin_memory() copied a pageable tensor: allocate pinned directly")

    monkeypatch.setattr(host_sync, "pinned", lambda device: True)
    monkeypatch.setattr(host_sync, "_is_pinned", lambda t: t.device.type == "cpu")
    monkeypatch.setattr(torch, "empty", recording_empty)
    monkeypatch.setattr(torch.Tensor, "pin_memory", no_pageable_copy)
    return asked


def store(contiguous: bool) -> CheckpointStore:
    grid = SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0)
    cfg = ActivationCheckpointConfig(checkpoint_activations=True, cpu_checkpointing=True,
                                     contiguous_memory_optimization=contiguous)
    return CheckpointStore(grid, cfg, slots=3)


def test_host_pieces_are_counted_at_their_power_of_two_blocks(pinned_host):
    s = store(contiguous=False)
    shapes = [(3, 100), (5, 77), (4, 64)]  # 1200, 1540, 1024 bytes of fp32
    saved = [s.save(torch.randn(shape)) for shape in shapes]
    data = [4 * a * b for a, b in shapes]
    report = s.report()
    assert report["saved_host_bytes"] == sum(block(n) for n in data) == 2048 + 2048 + 1024
    assert report["pinned_rounding"] == sum(block(n) - n for n in data)
    assert report["peak_saved_host_bytes"] == report["saved_host_bytes"]
    assert pinned_host == [True] * 3  # each piece allocated pinned, none copied into pinned memory
    for x in saved:
        s.release(x)
    assert s.report()["saved_host_bytes"] == s.report()["pinned_rounding"] == 0


def test_an_md_buffer_is_rounded_once_not_per_slot(pinned_host):
    s = store(contiguous=True)
    saved = [s.save(torch.randn(5, 77)) for _ in range(2)]  # 3 slots of 1540 bytes: 4620 -> 8192
    report = s.report()
    assert report["md_buffer_bytes"] == block(3 * 1540) == 8192
    assert report["pinned_rounding"] == 8192 - 3 * 1540
    assert report["saved_host_bytes"] == 2 * 1540  # slots of the one buffer: no block of their own
    assert pinned_host == [True]
    for x in saved:
        s.release(x)
