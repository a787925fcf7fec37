"""The trainer's checkpoint saves, synchronous or in the background (``checkpoint.async_save``),
and what each costs: one ``metrics.jsonl`` record per committed save.

``checkpoint_blocking_s`` is how long the loop stood still for the save (for a background save:
the copy to host memory, plus any wait for the writer and the commit later), and
``checkpoint_total_s`` how long from the save step to the commit. A synchronous save blocks for
all of it. The record carries the step the loop had reached when the save committed (``step``,
so wandb's steps only grow) and the checkpoint's own (``checkpoint_step``).
"""

from __future__ import annotations

import time
from pathlib import Path

from zerotron.parallel import collectives as C
from zerotron.checkpoint import distributed as ckpt
from zerotron.checkpoint.async_save import BackgroundWriter, Committed
from zerotron.checkpoint.files import complete_checkpoints
from zerotron.checkpoint.export import write_consolidated


class Saves:
    """Saves of one ``Trainer``: ``save`` at a save step, ``finish`` once every writer is done."""

    def __init__(self, trainer):
        self.t = trainer
        c = trainer.cfg.checkpoint
        self.writer = BackgroundWriter(trainer.grid, trainer.env.device) if c.async_save else None

    def writing(self) -> bool | None:
        """None: no background save in flight (alike on every rank); else whether this rank's
        writer is still at work."""
        return None if self.writer is None else self.writer.writing()

    def save(self, wait: bool = True) -> Path:
        """Collective: write a checkpoint of this step; in the background with async_save, where
        ``wait`` commits it before returning (the last save, SIGTERM). At most one is in flight:
        a save still being written is committed first."""
        t, c = self.t, self.t.cfg.checkpoint
        self.finish()
        fields = dict(consumed_samples=t.consumed, model_config=t.model_config_dict(),
                      run_config=t.cfg.to_dict(), rng_states=t._rng_states(), run_id=t.run_id)
        if self.writer is None:
            start = time.perf_counter()
            path = ckpt.save_checkpoint(c.save, t.step, t.model, t.opt, t.grid,
                                        keep_last=c.keep_last, tokenizer=t.data.tokenizer_path,
                                        **fields)
            self._committed(Committed(path, t.step, start, 0.0), start)
            return path
        path = self.writer.start(c.save, t.step, t.model, t.opt, **fields)
        t.log(f"[checkpoint] writing {path} in the background")
        if wait:
            self.finish()
        return path

    def finish(self) -> None:
        """Collective: commit the save in flight, waiting for this rank's writer; else nothing."""
        if self.writer is None or self.writer.pending is None:
            return
        start = time.perf_counter()
        c = self.t.cfg.checkpoint
        done = self.writer.finish(c.save, keep_last=c.keep_last,
                                  tokenizer=self.t.data.tokenizer_path)
        self._committed(done, start)

    def abandon(self) -> None:
        """The run is failing: this rank's writer finishes its file, nothing commits (no
        collective: a peer may be dead)."""
        step = self.writer.abandon() if self.writer is not None else None
        if step is not None:
            done = complete_checkpoints(self.t.cfg.checkpoint.save)
            self.t.log(f"[checkpoint] step_{step:08d} was written in the background but not "
                       f"committed: the run stopped before every rank agreed; the newest complete "
                       f"checkpoint is {done[-1] if done else 'none'}")

    def _committed(self, done: Committed, start: float) -> None:
        """Say it, export the consolidated copy if asked, and log the save's record."""
        t = self.t
        t.log(f"[checkpoint] saved {done.path}")
        if t.cfg.checkpoint.consolidated_16bit:  # DeepSpeed's gather_16bit_weights_on_model_save
            if t.grid.rank == 0:
                written = write_consolidated(done.path, t.cfg.training.precision)
                t.log(f"[checkpoint] wrote {written}")
            C.barrier(t.grid.world_group)
        t.run_log.saved(done.path)
        now = time.perf_counter()  # ``start``: when this call began (the save, when synchronous)
        t.logger.log({"step": t.step, "checkpoint_step": done.step,
                      "checkpoint_async": self.writer is not None,
                      "checkpoint_blocking_s": done.blocking_s + now - start,
                      "checkpoint_total_s": now - done.started})
