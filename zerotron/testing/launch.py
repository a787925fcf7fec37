"""Run a function on N gloo ranks on CPU, fast, and never hang: the one launcher of the tests,
the benchmarks and the ablation runner.

Workers are *forked* by default (no torch re-import: start-up dominates on a small machine;
``start_method="spawn"`` for callers whose parent already started threads, e.g. DeepSpeed), call
``torch.set_num_threads(threads)``, join a gloo group through a ``FileStore`` and run
``fn(*args)``. Each worker reports its return value or its traceback through a pipe. The parent
waits until every rank has answered, one rank has failed (the others are then killed, since they
may sit in a collective waiting for it), or the deadline passes -- in which case every worker is
killed and the ranks that never answered are named.

Reference computations belong inside ``fn`` (run on every rank), not in the parent: the parent
must not start OpenMP threads before forking.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import signal
import tempfile
import time
import traceback
from typing import Any, Callable

DEFAULT_TIMEOUT_S = 120.0


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


class RankFailure(RuntimeError):
    """One or more ranks raised, died or timed out."""


def _worker(rank: int, world_size: int, store_path: str, conn, collective_timeout: float, threads: int,
            fn: Callable, args: tuple, kwargs: dict) -> None:
    try:
        import datetime
        import faulthandler
        import signal

        stacks = open(_stack_file(store_path, rank), "w")  # faulthandler keeps it open
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # read by _stacks
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          ZEROTRON_DEVICE="cpu", ZEROTRON_JOB_ID=store_path)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout))
        result = fn(*args, **kwargs)
        try:
            payload = pickle.dumps(("ok", result))
        except Exception:  # unpicklable result: report its repr
            payload = pickle.dumps(("ok", repr(result)))
        conn.send_bytes(payload)
        # Leave together: a rank that exits while a slower peer is still connecting its gloo mesh
        # makes that peer's init_process_group fail ("connectFullMesh ... closed by peer").
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the result is already reported
            pass
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        conn.send_bytes(pickle.dumps(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")))
    finally:
        conn.close()
        os._exit(0)  # skip pytest's atexit hooks inherited through fork


def _stack_file(store_path: str, rank: int) -> str:
    return os.path.join(os.path.dirname(store_path), f"stack.{rank}")


def _preload() -> None:
    """Import in the parent what every rank would otherwise import for itself: forked ranks share
    it. ``torch._dynamo`` alone (imported lazily by ``torch.optim``) costs each rank a second of
    CPU, several on a loaded 2-core machine where 4-8 ranks import it at once. Importing starts no
    thread, so forking stays safe; after the first call each import is a lookup in sys.modules."""
    import torch._dynamo  # noqa: F401

    import zerotron.config.cli  # noqa: F401
    import zerotron.training.trainer  # noqa: F401


class Ranks:
    """``fn(*args, **kwargs)`` running on ``world_size`` gloo ranks: started at construction,
    answered by ``wait``, killed (what is left of them) by ``close``. ``spawn`` is the usual way in;
    a caller holds a ``Ranks`` itself to let two jobs run at once -- fault drills that sit idle in
    a collective timeout overlap their waits. Ranks in ``may_die`` (fault drills) may exit without
    a result; theirs is then ``None``, and once every other rank has answered they are not waited
    for (a frozen culprit is killed and reported ``None``). The rendezvous file lives in a fresh
    folder under ``store_dir`` (the system temp dir when None) and is removed by ``close``."""

    def __init__(self, fn: Callable, world_size: int, *args: Any, collective_timeout: float = 30.0,
                 may_die: tuple[int, ...] = (), start_method: str = "fork", threads: int = 1,
                 store_dir: str | None = None, **kwargs: Any):
        ctx = mp.get_context(start_method)
        forking = start_method == "fork"
        if forking:
            _preload()
        if store_dir is not None:
            os.makedirs(store_dir, exist_ok=True)
        self.world_size, self.may_die = world_size, may_die
        self._tmp = tempfile.mkdtemp(prefix="zerotron_store_", dir=store_dir)
        store_path = os.path.join(self._tmp, "store")
        self.procs, self.conns = [], []
        try:
            if forking:  # Python's advice before a fork: a rank's gc.collect() would otherwise walk, and
                gc.freeze()  # copy page by page, the whole inherited heap (0.4 s a call here)
            for rank in range(world_size):
                parent_end, child_end = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_worker, args=(rank, world_size, store_path, child_end, collective_timeout,
                                                      threads, fn, args, kwargs), daemon=True)
                p.start()
                child_end.close()
                self.procs.append(p)
                self.conns.append(parent_end)
        except BaseException:
            self.close()
            raise
        finally:
            if forking:
                gc.unfreeze()  # the parent's collector sees its objects again; the ranks keep theirs frozen

    def __enter__(self) -> "Ranks":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait(self, timeout: float = DEFAULT_TIMEOUT_S) -> list[Any]:
        """The per-rank results. Raises ``RankFailure`` naming the failed rank(s), with their
        tracebacks, if any rank raises, dies, or does not finish within ``timeout`` seconds."""
        world_size, may_die, procs, conns = self.world_size, self.may_die, self.procs, self.conns
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < world_size and not errors:
            if all(r in results for r in range(world_size) if r not in may_die):
                # the drill's verdict is in: a frozen or stalled culprit is not waited for
                results.update({r: None for r in may_die if r not in results})
                break
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(results) - set(errors))
                raise RankFailure(f"timed out after {timeout:.0f}s; rank(s) {missing} never finished "
                                  f"(a hang: mismatched or missing collective?)" + self._stacks(missing))
            for rank, conn in enumerate(conns):
                if rank in results or rank in errors:
                    continue
                if conn.poll(0.01):
                    try:
                        status, value = pickle.loads(conn.recv_bytes())
                    except EOFError:
                        status, value = "error", f"rank {rank} exited (code {procs[rank].exitcode}) without a result"
                        if rank in may_die:
                            status, value = "ok", None
                    (results if status == "ok" else errors)[rank] = value
                elif not procs[rank].is_alive() and not conn.poll(0.05):
                    if rank in may_die:
                        results[rank] = None
                    else:
                        errors[rank] = f"rank {rank} died with exit code {procs[rank].exitcode}"
        if errors:
            text = "\n".join(f"--- rank {r} failed ---\n{msg}" for r, msg in sorted(errors.items()))
            silent = sorted(set(range(world_size)) - set(results) - set(errors))
            raise RankFailure(f"{len(errors)} rank(s) failed: {sorted(errors)}\n{text}"
                              + self._stacks(silent))
        return [results[r] for r in range(world_size)]

    def _stacks(self, ranks: list[int], wait_s: float = 2.0) -> str:
        """Where each of ``ranks`` (alive, not answered) is now: every thread's Python stack, by
        faulthandler on SIGUSR1 -- also inside C code, such as a rendezvous or a lock inherited
        through the fork -- so a hang that shows once under load names its cause in the report."""
        alive = [r for r in ranks if self.procs[r].is_alive()]
        for r in alive:
            os.kill(self.procs[r].pid, signal.SIGUSR1)
        paths = {r: _stack_file(os.path.join(self._tmp, "store"), r) for r in alive}
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not all(_size(p) for p in paths.values()):
            time.sleep(0.02)
        time.sleep(0.05)  # the dump is a few writes: let the last land
        parts = []
        for r, path in paths.items():
            try:
                with open(path) as f:
                    stack = f.read()[:3000]  # most recent call first
            except OSError:
                continue
            parts.append(f"\n--- rank {r} was still running, at ---\n{stack}" if stack else "")
        return "".join(parts)

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        for c in self.conns:
            c.close()
        try:
            for name in os.listdir(self._tmp):
                os.unlink(os.path.join(self._tmp, name))
            os.rmdir(self._tmp)
        except OSError:
            pass


def spawn(fn: Callable, world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks (``Ranks``, whose keyword options
    it takes); return the per-rank results once every rank not in ``may_die`` has answered, or
    raise ``RankFailure`` (``Ranks.wait``) on a failure or after ``timeout`` seconds."""
    with Ranks(fn, world_size, *args, **kwargs) as ranks:
        return ranks.wait(timeout)
