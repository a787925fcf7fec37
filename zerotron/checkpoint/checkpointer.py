"""The run's one ``Checkpointer``: its directory locks, which checkpoint it continues, the load,
and every save -- synchronous or in the background (``checkpoint.async_save``) -- with its cost.

As torchtitan's trainer holds one ``CheckpointManager``, the trainer holds one of these, made once
from the run config's ``checkpoint`` section, the grid and the run's identity (``RunIdentity``).
``for_run`` starts it: rank 0 takes the run and checkpoint directories' locks (``run_lock.py``),
every rank learning the outcome (``parallel/agreement.py``), and ``resume.plan_resume`` picks the
verified checkpoint that continues the run. ``track`` names what a save holds, ``load`` restores
the planned checkpoint into it, ``save`` runs ``write.py``'s three phases (the middle one on
``async_save.py``'s writer thread). A save goes down: here -> ``async_save`` -> ``write`` ->
``agree`` -> ``files``; a resume: here -> ``resume`` -> ``files`` and here -> ``distributed``.

Each committed save logs one ``metrics.jsonl`` record: ``checkpoint_blocking_s``, how long the
loop stood still for it (in the background: the copy to host memory, plus any wait for the writer
and the commit later), and ``checkpoint_total_s``, from the save step to the commit. The record
carries the step the loop had reached at the commit (``step``, so wandb's steps only grow) and
the checkpoint's own (``checkpoint_step``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from zerotron.parallel.agreement import rank0_decides
from zerotron.checkpoint import write
from zerotron.checkpoint.async_save import BackgroundWriter
from zerotron.checkpoint.distributed import load_checkpoint, shard_contents
from zerotron.checkpoint.export import write_consolidated
from zerotron.checkpoint.files import CheckpointError, complete_checkpoints
from zerotron.checkpoint.resume import ResumePlan, check_tokenizer, plan_resume, run_id
from zerotron.checkpoint.run_lock import RunLock, RunLockError


@dataclass
class RunIdentity:
    """What each checkpoint of a run records about the run."""

    run_id: str  # ``resume.run_id``: pruning deletes only this run's checkpoints
    config: dict = field(default_factory=dict)  # the run config: metadata.json's "config"
    tokenizer: str | None = None  # the run's tokenizer; each checkpoint keeps a copy


@dataclass
class Committed:
    """A save every rank has committed, as its ``metrics.jsonl`` record reports it."""

    path: Path
    step: int
    started: float  # time.perf_counter() when the save step began
    blocking_s: float  # seconds the loop stood still for it before the call that committed it


class Checkpointer:
    """Saves and loads of one run; every method that says "collective" runs on every rank."""

    def __init__(self, section, grid, device: torch.device, identity: RunIdentity,
                 log: Callable[[str], None] = print):
        self.section, self.grid, self.device, self.identity = section, grid, device, identity
        self.log = log  # the trainer's: prints on rank 0
        self.locks: list[RunLock | None] = []
        self.plan = ResumePlan()  # from scratch unless ``for_run`` planned a resume
        self.model = self.opt = None
        self.model_config: dict = {}
        self.writer = BackgroundWriter(grid, device) if section.async_save else None
        self._record: Callable[[dict], None] = lambda record: None  # report_to replaces these
        self._saved: Callable[[Path], None] = lambda path: None

    @classmethod
    def for_run(cls, cfg, grid, device: torch.device, log: Callable[[str], None]) -> "Checkpointer":
        """Collective: the run's checkpointer, its directories locked and its resume planned;
        raises ``CheckpointError`` (``RunLockError``, a refused resume) or ``AlreadyComplete``."""
        ck = cls(cfg.checkpoint, grid, device, RunIdentity(run_id(cfg), cfg.to_dict()), log)
        try:
            ck.locks.append(ck._take_lock(cfg.logging.run_dir, "logging.run_dir"))
            save = cfg.checkpoint.save  # one lock file serves both when they are one directory
            if save and Path(save).resolve() != Path(cfg.logging.run_dir).resolve():
                ck.locks.append(ck._take_lock(save, "checkpoint.save"))
            ck.plan = plan_resume(cfg, grid, device, log)
        except BaseException:
            ck.release()
            raise
        return ck

    def _take_lock(self, directory: str, field_name: str) -> RunLock | None:
        """Collective: rank 0 takes ``directory``'s lock, or every rank raises ``RunLockError``
        with its message. The lock on rank 0, None elsewhere."""
        taken: list[RunLock] = []

        def take() -> str:
            taken.append(RunLock.acquire(directory, self.identity.run_id, field=field_name))
            return taken[0].note or ""

        note = rank0_decides(take, self.grid, self.device, failures=(RunLockError,))
        if note:
            self.log(f"[checkpoint] {note}")
        return taken[0] if taken else None

    def release(self) -> None:
        """Give the run and checkpoint directories back (rank 0; safe after a failed collective)."""
        for lock in self.locks:
            if lock is not None:
                lock.release()

    # what a save holds, and the load --------------------------------------------------------
    def use_tokenizer(self, tokenizer: str | None, cfg) -> None:
        """The run's tokenizer, kept in each checkpoint; refused (``CheckpointError``) when it
        encodes otherwise than the one of the checkpoint the run continues."""
        if self.plan.path is not None:
            check_tokenizer(self.plan.path, tokenizer, cfg)
        self.identity.tokenizer = tokenizer

    def track(self, model, opt, model_config: dict) -> None:
        """The model and ZeRO optimizer a save holds and a load fills; ``model_config``: the
        model's fields for metadata.json (a load compares them with the checkpoint's)."""
        self.model, self.opt, self.model_config = model, opt, model_config

    def load(self, path: str | Path | None = None) -> dict[str, Any] | None:
        """Collective: the planned checkpoint (or ``path``) loaded into the tracked model and
        optimizer, in this layout; ``load_checkpoint``'s summary, None when there is none."""
        if path is None and self.plan.path is None:
            return None
        verified = self.plan.verified if path is None else frozenset()  # hashed while planning
        return load_checkpoint(str(path or self.plan.path), self.model, self.opt, self.grid,
                               model_config=self.model_config, log=self.log, verified=verified)

    # saves ------------------------------------------------------------------------------------
    def writing(self) -> bool | None:
        """None: no background save in flight (alike on every rank); else whether this rank's
        writer is still at work."""
        return None if self.writer is None else self.writer.writing()

    def save(self, step: int, *, consumed_samples: int,
             rng_states: dict[str, torch.Tensor] | None = None, wait: bool = True) -> Path:
        """Collective: write the checkpoint of ``step``; returns its directory. In the background
        with async_save, where ``wait`` commits it before returning (the last save, SIGTERM). At
        most one is in flight: a save still being written is committed first."""
        self.finish(step)
        started = time.perf_counter()
        s, ident = self.section, self.identity
        tmp = write.open_checkpoint(s.save, step, self.grid, ident.run_id, self.device)
        tensors, meta, state = shard_contents(self.model, self.opt, self.grid, rng_states or {})
        header = write.checkpoint_header(step, self.opt, self.grid, state,
                                         consumed_samples=consumed_samples, run_id=ident.run_id,
                                         model_config=self.model_config, run_config=ident.config)
        if self.writer is None:
            error = write.write_own_shard(tmp, step, self.grid, tensors, meta)
            path = self._commit(tmp, error, header)
            self._committed(Committed(path, step, started, 0.0), started, step)
            return path
        self.writer.start(tmp, step, tensors, meta, header, started)
        path = write.step_dir(s.save, step)
        self.log(f"[checkpoint] writing {path} in the background")
        if wait:
            self.finish(step)
        return path

    def _commit(self, tmp: Path, error: OSError | None, header: dict) -> Path:
        s = self.section
        return write.commit_checkpoint(s.save, tmp, error, self.grid, self.device, header,
                                       keep_last=s.keep_last, tokenizer=self.identity.tokenizer)

    def finish(self, step: int) -> None:
        """Collective: commit the save in flight, waiting for this rank's writer; else nothing.
        ``step``: the loop's, for the record."""
        if self.writer is None or self.writer.pending is None:
            return
        start = time.perf_counter()
        pending = self.writer.wait()
        path = self._commit(pending.tmp, pending.error, pending.header)
        done = Committed(path, pending.step, pending.started, pending.blocking_s)
        self._committed(done, start, step)

    def abandon(self) -> None:
        """The run is failing: this rank's writer finishes its file, nothing commits (no
        collective: a peer may be dead)."""
        step = self.writer.abandon() if self.writer is not None else None
        if step is not None:
            done = complete_checkpoints(self.section.save)
            self.log(f"[checkpoint] step_{step:08d} was written in the background but not "
                     f"committed: the run stopped before every rank agreed; the newest complete "
                     f"checkpoint is {done[-1] if done else 'none'}")

    def report_to(self, record: Callable[[dict], None], saved: Callable[[Path], None]) -> None:
        """Where each committed save goes: ``record`` takes its metrics.jsonl record, ``saved``
        its directory."""
        self._record, self._saved = record, saved

    def _committed(self, done: Committed, start: float, step: int) -> None:
        """Say it, export the consolidated copy if asked, and log the save's record."""
        self.log(f"[checkpoint] saved {done.path}")
        if self.section.consolidated_16bit:  # DeepSpeed's gather_16bit_weights_on_model_save
            self.log(f"[checkpoint] wrote {self.export_consolidated(done.path)}")
        self._saved(done.path)
        now = time.perf_counter()  # ``start``: when this call began (the save, when synchronous)
        self._record({"step": step, "checkpoint_step": done.step,
                      "checkpoint_async": self.writer is not None,
                      "checkpoint_blocking_s": done.blocking_s + now - start,
                      "checkpoint_total_s": now - done.started})

    def export_consolidated(self, path: Path) -> str:
        """Collective: rank 0 writes ``consolidated.safetensors`` into checkpoint ``path`` in the
        run's working dtype; every rank returns its path or raises rank 0's error."""
        precision = self.identity.config.get("training", {}).get("precision", "fp32")
        return rank0_decides(lambda: str(write_consolidated(str(path), precision)), self.grid,
                             self.device, failures=(CheckpointError, OSError))
