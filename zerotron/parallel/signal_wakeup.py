"""The signals this process received, seen by a thread while the main thread is blocked in C.

torchrun ends a job whose rank died with SIGTERM to the survivors and SIGKILL 30 s later. A
survivor blocked in a collective under NCCL never runs its Python SIGTERM handler (the main
thread sits in a CUDA sync), so without this it dies nameless. Python's C-level handler still
writes the signal's number to the ``signal.set_wakeup_fd`` descriptor, from any state of the
main thread; the health watchdog (``health.py``) waits on it, and on SIGTERM while a collective
is pending names the rank it waits for before torchrun's SIGKILL (as torchtitan's and
Megatron's flight recorders dump on SIGTERM). The descriptor is taken only when no one else
(asyncio) holds it, and only from the main thread, as Python requires.
"""

from __future__ import annotations

import os
import select
import signal
import threading


class SignalWakeup:
    def __init__(self) -> None:
        self._read_fd = None
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

    def wait(self, timeout_s: float) -> set[int]:
        """The signal numbers received within ``timeout_s`` (empty: none, or no descriptor)."""
        if self._read_fd is None:
            return set()
        ready, _, _ = select.select([self._read_fd], [], [], timeout_s)
        return set(os.read(self._read_fd, 512)) if ready else set()
