"""Progress of a long data job that a person can read on a terminal and in a log file alike.

Why not tqdm alone: off a terminal (a SLURM log, ``nohup``, CI) tqdm's carriage returns pile up
into one unreadable line, or the bar is turned off and the job looks hung for an hour. So a
terminal gets tqdm's bar and any other stream gets one plain line every ``interval`` seconds:
done / total (percent), rates, elapsed time and ETA -- the ETA whenever the total is known.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def clock(seconds: float) -> str:
    """``h:mm:ss`` (``m:ss`` under an hour), as tqdm prints durations."""
    s = int(max(seconds, 0))
    h, rem = divmod(s, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60}:{rem % 60:02d}"


def human(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


class Progress:
    """Counts ``unit`` items towards ``total`` (None: unknown) and a second counter, ``tokens``.

    ``enabled=False`` prints nothing; ``tty=None`` asks the stream. ``update`` is cheap: lines
    and bar refreshes are rate-limited, not per call.
    """

    def __init__(self, desc: str, total: int | None = None, unit: str = "doc", enabled: bool = True,
                 interval: float = 10.0, stream: TextIO | None = None, tty: bool | None = None):
        self.desc, self.total, self.unit, self.interval = desc, total, unit, interval
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.done = self.tokens = 0
        self._shown: int | None = None  # self.done when the last plain line was printed
        self.start = self._last = time.perf_counter()
        self._bar = None
        if enabled and (self.stream.isatty() if tty is None else tty):
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit=unit, unit_scale=True, desc=desc, file=self.stream,
                             mininterval=1.0, smoothing=0.1, dynamic_ncols=True)

    def update(self, n: int, tokens: int = 0) -> None:
        self.done += n
        self.tokens += tokens
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._bar is not None:
            self._bar.update(n)
            if now - self._last >= 1.0:
                self._bar.set_postfix_str(f"{human(self.tokens / max(now - self.start, 1e-9))} tok/s", refresh=False)
                self._last = now
        elif now - self._last >= self.interval:
            self._line(now)
            self._last = now

    def line(self, now: float | None = None) -> str:
        """The plain status line: ``desc: 1.20k/5.00k doc (24.0%), 310 doc/s, 1.05M tok/s, 0:04 elapsed, ETA 0:12``."""
        now = time.perf_counter() if now is None else now
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        parts = [f"{human(self.done)}/{human(self.total)} {self.unit} ({100 * self.done / max(self.total, 1):.1f}%)"
                 if self.total else f"{human(self.done)} {self.unit}",
                 f"{human(rate) if rate >= 10 else f'{rate:.2f}'} {self.unit}/s"]
        if self.tokens:
            parts.append(f"{human(self.tokens / elapsed)} tok/s")
        parts.append(f"{clock(elapsed)} elapsed")
        if self.total:
            left = (self.total - self.done) / rate if rate > 0 else float("inf")
            parts.append(f"ETA {clock(left) if left != float('inf') else '?'}")
        return f"{self.desc}: " + ", ".join(parts)

    def _line(self, now: float) -> None:
        print(self.line(now), file=self.stream, flush=True)
        self._shown = self.done

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        elif self._shown != self.done:  # the last line already says where it ended
            self._line(time.perf_counter())
