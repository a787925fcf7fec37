"""One run per checkpoint directory and per run directory: a lock file that names its holder.

Two runs writing into one directory would prune, overwrite and resume each other's
checkpoints, or (the run directory, ``logging.run_dir``) overwrite each other's ``config.yaml``
and supersede each other's ``metrics.jsonl`` records; both directories are locked. Rank 0
therefore creates ``<save>/zerotron.lock`` (``O_CREAT | O_EXCL``) before any
work and removes it when the run ends, however it ends. A second run finds the file and is
refused with the holder's host and pid. A stale lock -- a crash, ``kill -9``, a node reboot --
is taken over with a message, so ``torchrun --max-restarts`` or a requeued job continues by
itself. On the holder's host, stale means its pid is not alive (or now belongs to a process
started later). Another host cannot be probed, so the holder refreshes the file's mtime every
``REFRESH_S`` from a thread, and a lock from another host is stale once it has not been
refreshed for ``STALE_S`` (rank 0 of a restarted job often lands on another node). A lock
held on another host by an earlier attempt of this same job (``lineage``: same SLURM job or
torchrun run id, a lower restart count) is taken over at once: a restart begins only once the
earlier attempt's ranks are gone.

The check-then-take-over is serialized with ``flock`` on the directory, so two runs that find
the same stale lock at once cannot both take it (where the file system has no ``flock``, the
``O_EXCL`` create alone decides, with a short race window on takeovers only).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from zerotron.checkpoint.files import CheckpointError

LOCK_NAME = "zerotron.lock"
REFRESH_S = 15.0  # the holder touches the lock this often
STALE_S = 120.0  # a lock from another host not touched for this long belongs to a dead run


class RunLockError(CheckpointError):
    """The checkpoint directory belongs to another run that is still alive (or cannot be probed)."""


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), or None.

    Recorded in the lock so a pid reused by an unrelated process later does not look alive."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int, start_ticks: int | None) -> bool:
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 2**31:  # no kill(0), (-1)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        pass
    now = _start_ticks(pid)
    return start_ticks is None or now is None or now == start_ticks


@contextlib.contextmanager
def _serialized(directory: Path):
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX)
        except (ImportError, OSError):  # no flock here: O_EXCL alone decides
            pass
        yield
    finally:
        os.close(fd)  # closing releases the flock


def _idle_s(path: Path) -> float:
    try:
        return max(0.0, time.time() - path.stat().st_mtime)
    except OSError:
        return 0.0


def _read(path: Path) -> dict | None:
    """The holder a lock file names, or None when it cannot be read or is not a lock (a corrupt
    file: garbage, or fields of the wrong type), which is taken over once it stops changing."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or isinstance(data.get("pid", 0), bool):
        return None
    started = data.get("started", 0)
    if not isinstance(data.get("pid", 0), int) or not isinstance(started, (int, float)):
        return None
    return data


def describe(holder: dict) -> str:
    return (f"host {holder.get('host')}, pid {holder.get('pid')}, run id {holder.get('run_id')}, "
            f"started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder.get('started', 0)))}")


def _refusal(directory: Path, path: Path, holder: dict, host: str,
             field: str = "checkpoint.save") -> str | None:
    """Why ``holder``'s lock on ``directory`` stands (the refusal to print), or None when it is
    stale. ``field``: the setting that names the directory (checkpoint.save, logging.run_dir)."""
    idle = _idle_s(path)
    ticks = holder.get("start_ticks")
    if holder.get("host") != host and idle < STALE_S:
        return (f"{field}={directory} is in use by a run on another host ({describe(holder)}; "
                f"{path}, refreshed {idle:.0f} s ago); wait for it to end or give this run another "
                f"{field}. If that run is gone, its lock is taken over once it has not "
                f"been refreshed for {STALE_S:.0f} s, or delete {path}")
    ticks = ticks if isinstance(ticks, int) else None
    if holder.get("host") == host and _alive(holder.get("pid", -1), ticks):
        also = (" (or logging.run_dir, when checkpoint.save is under it)"
                if field == "checkpoint.save" else "")
        return (f"{field}={directory} is in use by another run ({describe(holder)}; {path}); "
                f"wait for it to end or give this run another {field}{also}")
    return None


def job_key() -> str:
    """Which job this process belongs to, the same on every rank and node of it: the launcher's
    identity (SLURM job, torchrun run id and rendezvous address, or ``ZEROTRON_JOB_ID``, which
    the test launcher sets); "" when there is none. A lock held by one's own job is no refusal."""
    names = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "ZEROTRON_JOB_ID")
    return ",".join(f"{n}={os.environ[n]}" for n in names if os.environ.get(n))


def lineage() -> tuple[str, list[int]]:
    """The job this process is an attempt of, the same across its restarts and requeues (SLURM's
    job id, else torchrun's ``--rdzv_id`` unless it is static rendezvous's "none"; "" when there is
    neither), and which attempt: [SLURM_RESTART_COUNT, TORCHELASTIC_RESTART_COUNT], which grow."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    job = (f"slurm:{os.environ['SLURM_JOB_ID']}" if os.environ.get("SLURM_JOB_ID")
           else f"torchelastic:{run_id}" if run_id and run_id != "none" else "")
    attempt = []
    for name in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        try:
            attempt.append(int(os.environ.get(name) or 0))
        except ValueError:
            return "", []
    return job, attempt


def check_free(directory: str | Path, field: str = "checkpoint.save") -> None:
    """Raise ``RunLockError`` if a live run holds ``directory``'s lock; a look that takes nothing.

    Every rank calls it in preflight, before ``init_process_group``, so a second run is refused
    in the seconds its imports take rather than after its process group, grid and start-up
    collectives (half a minute on a loaded machine). ``RunLock.acquire`` still decides when two
    runs start at the same moment."""
    path = Path(directory) / LOCK_NAME
    holder = _read(path)
    if holder and job_key() and holder.get("job") == job_key():  # rank 0 of this job took it first
        return
    host = socket.gethostname()
    refusal = _refusal(Path(directory), path, holder, host, field) if holder else None
    if refusal:
        raise RunLockError(refusal)


class RunLock:
    """The lock this process holds on a checkpoint directory; ``release()`` is idempotent."""

    def __init__(self, path: Path, info: dict, note: str | None, refresh_s: float | None):
        self.path, self.info, self.note = path, info, note
        self._stop = threading.Event()
        if refresh_s:
            threading.Thread(target=self._refresh, args=(path, refresh_s), name="zerotron-lock", daemon=True).start()

    def _refresh(self, path: Path, every: float) -> None:
        while not self._stop.wait(every):
            with contextlib.suppress(OSError):
                os.utime(path)

    @classmethod
    def acquire(cls, directory: str | Path, run_id: str, refresh_s: float | None = REFRESH_S,
                field: str = "checkpoint.save") -> "RunLock":
        """Take ``directory``'s lock (creating the directory) or raise ``RunLockError`` naming the holder.

        ``refresh_s``: how often a thread touches the lock while it is held (None: never; then a
        run on another host takes it over after ``STALE_S``)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / LOCK_NAME
        pid = os.getpid()
        job, attempt = lineage()
        info = {"host": socket.gethostname(), "pid": pid, "run_id": run_id, "started": time.time(),
                "start_ticks": _start_ticks(pid), "job": job_key(), "lineage": job, "attempt": attempt}
        note = None
        with _serialized(directory):
            for _ in range(20):
                try:
                    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                except FileExistsError:
                    holder = _read(path)
                    if holder is None:  # being written by its creator this instant, or garbage
                        if _idle_s(path) < 5.0:
                            time.sleep(0.25)
                            continue
                        holder = {}
                    idle = _idle_s(path)
                    # an earlier attempt of this very job on another host (torchrun --max-restarts,
                    # a requeue): a restart starts only once that attempt's ranks are gone
                    again = bool(holder) and bool(info["lineage"]) and holder.get("host") != info["host"] \
                        and holder.get("lineage") == info["lineage"] and list(holder.get("attempt", ())) < info["attempt"]
                    refusal = (_refusal(directory, path, holder, info["host"], field)
                               if holder and not again else None)
                    if refusal:
                        raise RunLockError(refusal)
                    why = ("an earlier attempt of this job" if again else "process no longer running"
                           if holder.get("host") == info["host"] else f"not refreshed for {idle:.0f} s") \
                        if holder else ""
                    note = (f"took over the stale lock of {describe(holder)} ({why})" if holder
                            else f"took over an unreadable lock file {path}")
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                    continue
                with os.fdopen(fd, "w") as f:
                    json.dump(info, f)
                    f.flush()
                    os.fsync(f.fileno())
                return cls(path, info, note, refresh_s)
        raise RunLockError(f"could not take the lock {path}: it keeps changing; another run is starting on "
                           f"{field}={directory}")

    def release(self) -> None:
        """Remove the lock file if it is still ours (never one another run took over meanwhile)."""
        self._stop.set()
        if self.path is None:
            return
        holder = _read(self.path)
        if holder is not None and all(holder.get(k) == self.info[k] for k in ("host", "pid", "started")):
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:  # read-only remount: one line, not a traceback over the stop
                print(f"[zerotron] could not remove the lock {self.path} ({e.strerror or e}); a "
                      f"later run takes it over once this process has ended (from another host, "
                      f"after {STALE_S:.0f} s)", file=sys.stderr, flush=True)
        self.path = None
