"""ZeRO-Infinity's NVMe tier: tensors kept in files, read ahead and written behind asynchronously.

Optimizer states of a partition (and, for stage 3, parameters) live as raw fp32 files in a
directory on local disk (NVMe on a cluster). The optimizer works tile by tile
(``sub_group_size`` elements): while tile i is being updated, tile i+1 is read ahead and tile
i-1 is written behind, so the disk streams while the CPU computes. At most ``buffer_count``
tiles are in host memory at once -- the bound that keeps memory independent of model size, as
DeepSpeed's ``offload_optimizer.buffer_count`` does.

Files are plain little-endian fp32 arrays, read and written with ``os.pread``/``os.pwrite`` in
worker threads (the GIL is released during file I/O), so no pickling or mmap page-cache surprises.

Under a dry run (``host_sync.simulated()``: fake tensors, no values) no file is made: reads return
uninitialised tiles of the right size, writes are dropped, both still counted in ``bytes_read`` /
``bytes_written``, and the I/O runs in the caller's thread, where the fake-tensor mode is active.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from zerotron.parallel import host_sync


def rank_directory(directory: str, prefix: str) -> str:
    """A fresh directory for one rank's files under ``directory``; under a dry run only its name
    (nothing is written there, so nothing is made)."""
    if host_sync.simulated():
        return os.path.join(directory, f"{prefix}dry_run")
    os.makedirs(directory, exist_ok=True)
    return tempfile.mkdtemp(prefix=prefix, dir=directory)


class DiskTensorStore:
    """Named flat fp32 tensors in files under ``directory``, with bounded async I/O."""

    def __init__(self, directory: str | Path, buffer_count: int = 4, io_threads: int = 2):
        if buffer_count < 2:
            raise ValueError(f"offload buffer_count={buffer_count}: need >= 2 (one tile computing, one in flight)")
        self.directory = Path(directory)
        self.simulated = host_sync.simulated()
        if not self.simulated:
            self.directory.mkdir(parents=True, exist_ok=True)
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="zerotron-disk")
        self._slots = threading.BoundedSemaphore(buffer_count)
        self.buffer_count = buffer_count
        self._files: dict[str, tuple[int, int]] = {}  # name -> (fd, numel)
        self.bytes_read = self.bytes_written = 0

    def create(self, name: str, init: torch.Tensor) -> None:
        """Create the file for ``name`` holding ``init`` (flat fp32)."""
        if self.simulated:
            self._files[name] = (-1, init.numel())
            return
        path = self.directory / f"{name}.f32"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        data = init.detach().reshape(-1).float().cpu().numpy().tobytes()
        os.pwrite(fd, data, 0)
        self._files[name] = (fd, init.numel())

    def numel(self, name: str) -> int:
        return self._files[name][1]

    def _read(self, name: str, start: int, end: int) -> torch.Tensor:
        fd, n = self._files[name]
        if not 0 <= start <= end <= n:
            raise IndexError(f"{name}: range [{start}, {end}) outside [0, {n})")
        if self.simulated:
            self.bytes_read += 4 * (end - start)
            return torch.empty(end - start, dtype=torch.float32)
        raw = os.pread(fd, 4 * (end - start), 4 * start)
        if len(raw) != 4 * (end - start):
            raise IOError(f"{self.directory / name}.f32 is truncated: read {len(raw)} of {4 * (end - start)} bytes")
        self.bytes_read += len(raw)
        return torch.from_numpy(np.frombuffer(raw, dtype=np.float32).copy())

    def _write(self, name: str, start: int, tensor: torch.Tensor) -> None:
        fd, _ = self._files[name]
        if self.simulated:
            self.bytes_written += 4 * tensor.numel()
            return
        data = tensor.detach().reshape(-1).float().cpu().numpy().tobytes()
        os.pwrite(fd, data, 4 * start)
        self.bytes_written += len(data)

    def read_ahead(self, name: str, start: int, end: int) -> Future:
        """Start reading ``name[start:end]``; blocks only when ``buffer_count`` tiles are in memory."""
        self._slots.acquire()
        return self._submit(self._read, name, start, end)

    def write_behind(self, name: str, start: int, tensor: torch.Tensor, take_slot: bool = False) -> Future:
        """Write ``tensor`` at ``start`` of ``name`` in the background and free its buffer slot after.

        ``take_slot``: the buffer was not read through ``read_ahead`` (a fresh one), so take a slot for
        it here -- blocking while ``buffer_count`` buffers are in memory, the write-behind bound."""
        if take_slot:
            self._slots.acquire()

        def job():
            try:
                self._write(name, start, tensor)
            finally:
                self._slots.release()
        return self._submit(job)

    def _submit(self, fn, *args) -> Future:
        if not self.simulated:
            return self._pool.submit(fn, *args)
        done: Future = Future()  # run now, but fail as the pool would: through the future
        try:
            done.set_result(fn(*args))
        except Exception as e:  # noqa: BLE001 -- re-raised by result(), as from a worker thread
            done.set_exception(e)
        return done

    def release(self) -> None:
        """Give back a slot taken by ``read_ahead`` whose tile is not written back."""
        self._slots.release()

    def read_range(self, name: str, start: int, end: int) -> torch.Tensor:
        """``name[start:end]``, synchronously and outside the buffer slots (a buffer used at once)."""
        return self._read(name, start, end)

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor, synchronously (checkpoints, tests)."""
        return self._read(name, 0, self.numel(name))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self._write(name, 0, tensor)

    def flush(self) -> None:
        """Wait for every pending write and make it durable."""
        self._pool.submit(lambda: None).result()
        for fd, _ in self._files.values():
            if fd >= 0:
                os.fsync(fd)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for fd, _ in self._files.values():
            if fd >= 0:
                os.close(fd)
        self._files.clear()


def measure_bandwidth(directory: str | Path, mbytes: int = 256) -> dict[str, float]:
    """Sequential write and read bandwidth of the disk under ``directory`` (GiB/s), fsync included."""
    path = Path(directory) / "zerotron_bandwidth_probe.bin"
    block = os.urandom(1 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(mbytes):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 22):
            pass
    read_s = time.perf_counter() - t0  # may be served by the page cache: an upper bound on the disk
    path.unlink()
    gb = mbytes / 1024
    return {"write_GiBps": gb / write_s, "read_GiBps": gb / read_s}
