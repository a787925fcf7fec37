"""Whether this process got SIGTERM, seen by a thread while the main thread is blocked in C.

torchrun ends a job whose rank died with SIGTERM to the survivors and SIGKILL 30 s later. A
survivor blocked in a collective under NCCL never runs its Python SIGTERM handler (the main
thread sits in a CUDA sync), so without this it dies nameless. Python's C-level handler still
writes the signal's number to the ``signal.set_wakeup_fd`` descriptor, from any state of the
main thread; the health watchdog (``health.py``) waits on it, and on SIGTERM while a collective
waits on a dead rank names that rank before torchrun's SIGKILL. The descriptor is one per
process (every ``Health`` of the process shares it, and the SIGTERM, once read, stays seen); it
is taken only when no one else (asyncio) holds it, and only from the main thread, as Python
requires. Without it, ``wait`` only sleeps.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time

_SHARED: SignalWakeup | None = None  # the process's one descriptor (a signal is per process)
_SHARED_LOCK = threading.Lock()


class SignalWakeup:
    def __init__(self) -> None:
        self._read_fd = None
        self._sigterm = threading.Event()
        if threading.current_thread() is not threading.main_thread():
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the C handler must never block on a full pipe
        try:
            previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:  # not the main thread of the main interpreter
            os.close(read_fd), os.close(write_fd)
            return
        if previous != -1:  # someone else's (an event loop): give it back, do without
            signal.set_wakeup_fd(previous)
            os.close(read_fd), os.close(write_fd)
            return
        self._read_fd = read_fd

    @classmethod
    def shared(cls) -> SignalWakeup:
        """The process's instance (made on first use; call it from the main thread)."""
        global _SHARED
        with _SHARED_LOCK:
            if _SHARED is None:
                _SHARED = cls()
            return _SHARED

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a signal; whether SIGTERM has been received (ever)."""
        if self._sigterm.is_set():  # seen: nothing left to wait for, but a caller that polls
            time.sleep(timeout_s)  # must not spin (a busy watchdog starves the training)
            return True
        if self._read_fd is None:
            self._sigterm.wait(timeout_s)  # nothing to read: a plain sleep
            return self._sigterm.is_set()
        ready, _, _ = select.select([self._read_fd], [], [], timeout_s)
        if ready and signal.SIGTERM in set(os.read(self._read_fd, 512)):
            self._sigterm.set()
        return self._sigterm.is_set()
