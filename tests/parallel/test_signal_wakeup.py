"""``SignalWakeup`` once SIGTERM is seen: every later ``wait`` still waits its timeout.

The health watchdog polls ``wait`` in a loop; returning at once after a SIGTERM turned that loop
into a busy one on every rank, which slowed the SIGTERM's own last step 10-40x (0.4 s to 14 s
at TP 2 x CP 2 on 2 cores, the drill's ``sigterm_save``). Run in a child process: the test sets
the process's wakeup descriptor and SIGTERM handler."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import os, signal, time
from zerotron.parallel.signal_wakeup import SignalWakeup
signal.signal(signal.SIGTERM, lambda *_: None)  # Python's C handler still writes the descriptor
w = SignalWakeup()
assert not w.wait(0.05)
os.kill(os.getpid(), signal.SIGTERM)
assert w.wait(5.0)
start, calls = time.monotonic(), 0
while time.monotonic() - start < 0.5:
    assert w.wait(0.1)  # seen, and stays seen
    calls += 1
print(calls)
"""


def test_a_seen_sigterm_does_not_make_wait_return_at_once():
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) <= 6, out.stdout  # 0.5 s of 0.1 s waits: 5 (or 6), not thousands
