"""The reliability drill's jobs: real ``torchrun scripts/pretrain_gpt.py`` runs, watched line by line.

The drill (``scripts/drill.py``) judges a fault by what a user would see -- the lines the job
prints, when it printed them, how it exited, what is left in its checkpoint directory -- so each
job is a real torchrun launch whose output lines are timestamped as they arrive. Workers import
zerotron from the checkout next to the script (``PYTHONPATH``), not whatever is installed, and
every temporary file of torchrun and the workers (``TMPDIR``) stays in the drill's directory.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"
VICTIM = 1  # the rank the drill kills, freezes or stalls: not rank 0, which holds the lock and logs


@dataclass(frozen=True)
class Layout:
    name: str
    nproc: int
    flags: tuple[str, ...]


def layouts(dp_nproc: int) -> dict[str, Layout]:
    return {"dp": Layout(f"DP {dp_nproc}", dp_nproc, ("--tp", "1")),
            "tp2xdp2": Layout("TP 2 x DP 2", 4, ("--tp", "2")),
            "tp2xpp2": Layout("TP 2 x PP 2", 4, ("--tp", "2", "--pp", "2")),
            "tp2xpp2xdp2": Layout("TP 2 x PP 2 x DP 2", 8, ("--tp", "2", "--pp", "2")),
            # context parallelism: the dead rank's ring neighbours must name it too
            "tp2xcp2": Layout("TP 2 x CP 2", 4, ("--tp", "2", "--cp", "2"))}


@dataclass
class Row:
    """One line of the drill's table. ``detect_s``: fault (or launch, for a start-up refusal) until
    the job printed what names it; ``ok``: detected as expected and nothing lost."""

    detected: str
    detect_s: float | None
    exit: str
    lost: str
    ok: bool
    notes: list[str] = field(default_factory=list)


class Job:
    """A torchrun job whose output lines (stdout and stderr together) are timestamped as they arrive."""

    def __init__(self, nproc: int, argv: list[str], env: dict[str, str], tmp: Path, torchrun: tuple[str, ...] = (),
                 log: Path | None = None):
        cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node", str(nproc), *torchrun,
               "scripts/pretrain_gpt.py", *argv]
        path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
        full_env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **env}
        self.nproc, self.start, self.end, self.log = nproc, time.monotonic(), None, log
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, text=True, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            t = time.monotonic()
            # ranks share the pipe and print writes text and newline apart, so one rank's line can
            # land inside another's: "[rank 0] config error: …[rank 1] config error: …"
            for part in re.split(r"(?=\[rank \d+\] )", line.rstrip()):
                if part:
                    self.lines.append((t, part))

    def wait(self, timeout: float) -> int:
        """torchrun's exit code; after ``timeout`` seconds the whole job is killed (-9)."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.wait()
            self.lines.append((time.monotonic(), f"[drill] killed after {timeout:.0f}s: the job did not end"))
            code = -9
        self._reader.join(timeout=5)
        self.end = self.end or time.monotonic()
        if self.log is not None:  # each line with its time since launch: what the drill judged
            self.log.parent.mkdir(parents=True, exist_ok=True)
            self.log.write_text("".join(f"[+{t - self.start:7.2f}s] {line}\n" for t, line in self.lines)
                                + f"[drill] exit {code}\n")
        return code

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in self._workers():  # SIGKILL reaches stopped processes too; SIGCONT then lets them die
            for sig in (signal.SIGKILL, signal.SIGCONT):
                _signal(pid, sig)

    def wait_for(self, pattern: str, timeout: float) -> float | None:
        """When a line matching ``pattern`` arrived (None: not within ``timeout`` or the job ended)."""
        deadline = time.monotonic() + timeout
        while True:
            hit = self.first(pattern)
            if hit or time.monotonic() > deadline or self.proc.poll() is not None:
                if hit is None and self.proc.poll() is not None:
                    self._reader.join(timeout=5)
                    hit = self.first(pattern)
                return hit[0] if hit else None
            time.sleep(0.05)

    def first(self, pattern: str) -> tuple[float, str] | None:
        return next(((t, line) for t, line in list(self.lines) if re.search(pattern, line)), None)

    def all(self, pattern: str) -> list[tuple[float, str]]:
        return [(t, line) for t, line in list(self.lines) if re.search(pattern, line)]

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def _workers(self) -> dict[int, int]:
        """``{rank: pid}`` of the training processes (children of torchrun with ``RANK`` set)."""
        found = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid != self.proc.pid:
                    continue
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
            if rank is not None:
                found[rank] = int(pid)
        return found

    def worker_pid(self, rank: int) -> int:
        pid = self._workers().get(rank)
        if pid is None:
            raise RuntimeError(f"no worker with RANK={rank} under torchrun {self.proc.pid}")
        return pid

    def signal_workers(self, sig: int) -> None:
        """``sig`` to every training process at once (not to torchrun)."""
        for pid in self._workers().values():
            _signal(pid, sig)

    def worker_exits(self) -> dict[int, int]:
        """``{rank: exit code}`` of the failed workers, from torchrun's failure report (-N: signal N)."""
        text = self.text()
        pairs = re.findall(r"rank\s*:\s*(\d+) \(local_rank.*?\n\s*exitcode\s*:\s*(-?\d+)", text)
        return {int(r): int(c) for r, c in pairs}

    def exited(self, code: int) -> bool:
        """Whether the workers that ended by themselves all exited ``code`` (torchrun's -15 for the
        ranks it stops after the first failure aside)."""
        return {c for c in self.worker_exits().values() if c != -15} == {code}

    def exit_text(self, code: int) -> str:
        """``0``, or the workers' codes and torchrun's: ``3 (rank 1: -9; torchrun 1)``. A -15 is
        torchrun stopping the remaining ranks after the first failure, and is left out."""
        if code == 0:
            return "0"
        workers = self.worker_exits()
        mains = sorted({c for c in workers.values() if c > 0})
        killed = [f"rank {r}: {c}" for r, c in sorted(workers.items()) if c <= 0 and c != -15]
        head = "/".join(map(str, mains)) if mains else "-"
        return f"{head} ({'; '.join(killed + [f'torchrun {code}'])})"


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def losses(run_dir: Path) -> dict[int, float]:
    """``{step: loss}`` from a run's metrics.jsonl (one record per step: a resumed run moves the
    earlier attempt's records past its checkpoint to metrics.superseded.jsonl; were one left, the
    last would win)."""
    out: dict[int, float] = {}
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "loss" in rec and "step" in rec:
            out[int(rec["step"])] = rec["loss"]
    return out


def complete_steps(save: Path) -> list[int]:
    """Steps of the complete checkpoints in ``save`` (a ``metadata.json`` marks completion)."""
    if not save.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in save.glob("step_*")
                  if p.name[5:].isdigit() and (p / "metadata.json").is_file())


def intact(save: Path) -> tuple[list[int], list[str]]:
    """Complete checkpoints of ``save`` and the problems found re-hashing every shard of each."""
    from zerotron.checkpoint.files import step_dir, verify_file

    steps, problems = complete_steps(save), []
    for step in steps:
        path = step_dir(save, step)
        try:
            for name, entry in json.loads((path / "metadata.json").read_text())["files"].items():
                verify_file(path / name, entry["sha256"])
        except Exception as e:  # noqa: BLE001 - the drill reports whatever is wrong
            problems.append(f"{path.name}: {e}")
    return steps, problems
