"""ZeRO-Infinity disk tier: tiles round-trip exactly through files with bounded async I/O."""

import threading

import pytest
import torch

from zerotron.zero.infinity.disk_store import DiskTensorStore, measure_bandwidth


def test_tiles_read_ahead_and_write_behind_round_trip(tmp_path):
    store = DiskTensorStore(tmp_path, buffer_count=2)
    x = torch.randn(10_000)
    store.create("master", x)
    tile = 3000
    futures = []
    for start in range(0, x.numel(), tile):  # the optimizer's loop: read, update, write back
        end = min(start + tile, x.numel())
        t = store.read_ahead("master", start, end).result()
        assert torch.equal(t, x[start:end])
        futures.append(store.write_behind("master", start, t * 2))
    for f in futures:
        f.result()
    store.flush()
    assert torch.equal(store.read("master"), x * 2)
    assert store.bytes_read == 4 * 10_000 * 2 and store.bytes_written == 4 * 10_000
    store.close()


def test_buffer_count_bounds_tiles_in_memory(tmp_path):
    store = DiskTensorStore(tmp_path, buffer_count=2)
    store.create("a", torch.zeros(100))
    store.read_ahead("a", 0, 10)
    store.read_ahead("a", 10, 20)
    third = threading.Thread(target=lambda: store.read_ahead("a", 20, 30), daemon=True)
    third.start()
    third.join(0.3)
    assert third.is_alive(), "a third tile must wait for a free buffer"
    store.release()
    third.join(2)
    assert not third.is_alive()


def test_truncated_file_and_bad_buffer_count(tmp_path):
    with pytest.raises(ValueError, match="buffer_count=1"):
        DiskTensorStore(tmp_path, buffer_count=1)
    store = DiskTensorStore(tmp_path)
    store.create("m", torch.ones(100))
    (tmp_path / "m.f32").write_bytes(b"\0" * 40)
    with pytest.raises(IOError, match="truncated"):
        store.read("m")


def test_bandwidth_probe(tmp_path):
    bw = measure_bandwidth(tmp_path, mbytes=8)
    assert bw["write_GiBps"] > 0 and bw["read_GiBps"] > 0


@pytest.mark.parametrize("simulated", [False, True], ids=["files", "dry_run"])
def test_a_bad_read_fails_through_its_future(tmp_path, simulated):
    """Callers handle I/O errors at ``result()``; a dry run's synchronous store must fail there too."""
    import contextlib

    from zerotron.parallel import host_sync

    with host_sync.simulate() if simulated else contextlib.nullcontext():
        store = DiskTensorStore(tmp_path / "nvme", buffer_count=2)
        store.create("state", torch.zeros(8))
        pending = store.read_ahead("state", 4, 12)  # past the end
        with pytest.raises(IndexError, match=r"state: range \[4, 12\) outside \[0, 8\)"):
            pending.result()
    assert (tmp_path / "nvme").exists() is not simulated
