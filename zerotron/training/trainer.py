"""The pretraining loop: micro-batches accumulated to the global batch, schedule, eval, logging,
checkpoints and a graceful stop on SIGTERM (checkpoint, then exit) for preemptible clusters.

It loops over a ``Run`` that ``build_run.py`` put together (grid, the Checkpointer with its
locks and resume plan, data, model, optimizer, loaders, the loaded checkpoint); what it builds
itself are the loop's meters (throughput, memory peaks, stragglers, profiler) and its logs. It
saves through the Run's ``Checkpointer`` (``checkpoint/checkpointer.py``).

The step (``training.step.run_step``) reads nothing on the host, nor does the trainer: the loss
stays on the device, a non-finite one is remembered there (``_watch_loss``) and read at the log
interval, before a checkpoint and at a stop; a logged step's metrics are read in one go. Left per
step: fp16's overflow decision (``host_sync``); the SIGTERM agreement is ``stop_cadence.py``'s.
"""

from __future__ import annotations

import math
import signal
from pathlib import Path

import torch

from zerotron.parallel import collectives as C
from zerotron.parallel import faults, host_sync
from zerotron.parallel import rng as rng_streams
from zerotron.training.metrics import CommWindow, MetricsLogger, PeakWindow, Throughput, host_values
from zerotron.training.phase_times import PhaseTimes
from zerotron.training.profiling import StepProfiler
from zerotron.zero.lr_schedule import betas_at, lr_at
from zerotron.training.stragglers import StragglerWatch
from zerotron.training.run_log import RunLog
from zerotron.training.build_run import Run
from zerotron.training.step import eval_step, run_step
from zerotron.training import step_events
from zerotron.training.stop_cadence import StopCadence, host_read_step


class TrainingStopped(RuntimeError):
    """The run cannot go on (NaN loss, loss-scale floor); the message says where to reproduce it."""


class Trainer:
    """The loop over a built ``Run`` (``build_run.py``): steps, evaluation, logs, saves, stops."""

    def __init__(self, run: Run):
        cfg, env, grid = run.cfg, run.env, run.grid
        self.run, self.cfg, self.env, self.grid, self.mcfg = run, cfg, env, grid, run.mcfg
        self.model, self.opt, self.activations = run.model, run.opt, run.activations
        self.memory = run.memory  # StepMemory: measured the construction; now one step a log
        self.data, self.checkpointer, self.eval_ds = run.data, run.checkpointer, run.eval_ds
        self.batches, self.eval_batches = run.batches, run.eval_batches
        self.step, self.consumed = run.step, run.consumed
        t, lg, dev = cfg.training, cfg.logging, env.device
        self.peaks = PeakWindow(dev)
        self.profiler = StepProfiler(lg.profile_steps, lg.run_dir, grid.rank, dev)
        self.stragglers = StragglerWatch(grid, dev, lg.straggler_factor)
        self.phases = PhaseTimes(self.memory, env.device) if lg.wall_clock_breakdown else None
        self.throughput = Throughput.of_run(cfg, self.mcfg, grid.world_size, env.device)
        self.run_log = RunLog(self)  # prints the banner (training/run_log.py)
        self.logger = MetricsLogger(lg.run_dir, self.run_log.tracked_config(), grid.rank == 0,
                                    lg.wandb_mode, lg.wandb_project, t.train_steps, self.step,
                                    lg.tensorboard)
        self.logger.keep_config(cfg.to_dict())  # config.yaml beside metrics.jsonl (rank 0)
        self.checkpointer.report_to(self.logger.log, self.run_log.saved)  # each save's record
        self._stop_requested = self.stopped = self._writes_done = False
        self.stop_cadence = StopCadence()  # which steps agree on a stop (stop_cadence.py)
        # first step whose loss was non-finite (-1: none yet) and that loss, kept on the device
        self._bad_step = torch.full((), -1.0, dtype=torch.float64, device=env.device)
        self._bad_loss = torch.zeros((), dtype=torch.float64, device=env.device)
        self._bad_norm = torch.zeros((), dtype=torch.float64, device=env.device)
        signal.signal(signal.SIGTERM, lambda signum, frame: setattr(self, "_stop_requested", True))

    def log(self, text: str) -> None:
        self.run.log(text)

    def _rng_states(self) -> dict[str, torch.Tensor]:
        return rng_streams.checkpoint_states(self.model.rng, self.env.device)

    def _dp_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean over DP x CP (a CP rank's loss is its share x cp), a 0-dim float64 device tensor."""
        x = value.detach().to(torch.float64).reshape(1).clone()
        C.all_reduce(x, self.grid.dp_cp_group, op="sum")
        return x[0] / self.grid.dp_cp_group.size

    MAX_SKIPS_AT_MIN_SCALE = 8  # consecutive overflowed (skipped) steps at the loss-scale floor

    def _inject_faults(self, step: int) -> None:
        """Drill hooks (zerotron/parallel/faults.py): kill or stall this rank, or poison a weight."""
        for point in ("kill", "stall", "pause", "slow"):
            faults.hit(point, step, self.grid.rank)
        if faults.armed("nan", step, self.grid.rank):  # init.constant_ fills under no_grad
            torch.nn.init.constant_(next(self.model.parameters()), float("nan"))

    def _watch_loss(self, loss: torch.Tensor, grad_norm=None) -> None:
        """Remember, on the device, the first step whose loss -- or, where no overflow skips the step
        (bf16, fp32), gradient norm -- is non-finite, and that loss: a non-finite gradient reaches
        the weights there, and a checkpoint of them must never be written."""
        bad = ~torch.isfinite(loss)
        if isinstance(grad_norm, torch.Tensor) and not self.opt.scaler.scaled:
            bad = bad | ~torch.isfinite(grad_norm)
        new = bad & (self._bad_step < 0)
        self._bad_step = torch.where(new, float(self.step + 1), self._bad_step)
        self._bad_loss = torch.where(new, loss.to(torch.float64), self._bad_loss)
        if isinstance(grad_norm, torch.Tensor):
            self._bad_norm = torch.where(new, grad_norm.to(torch.float64), self._bad_norm)

    def _check_finite(self) -> None:
        """Stop if a loss so far was non-finite, naming its step: one host read (``"nan"``), made
        at the log interval, before every checkpoint and at a stop, never per step. The loss is
        the same on every rank (DP mean, broadcast over the pipeline), so every rank agrees."""
        flags = torch.stack([self._bad_step, self._bad_loss, self._bad_norm])
        bad_step, loss, norm = host_sync.read(flags, "nan", placeholder=[-1.0, 0.0, 0.0])
        if bad_step < 0:
            return
        step = int(bad_step)
        consumed = self.consumed - (self.step - step + 1) * self.cfg.training.global_batch_size
        what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {norm} (loss {loss:.4g})"
        raise TrainingStopped(f"{what} at step {step} (consumed samples {consumed}); "
                              f"rerun from the last checkpoint with the same data position to reproduce")

    def _check_overflow_storm(self, info: dict, loss: torch.Tensor) -> None:
        """Overflows at the scale's floor (``min_loss_scale``, or a static ``loss_scale``) cannot be
        cured by scaling: after a few in a row (run at the floor: ``step_loss_scale``) the run only
        burns compute skipping steps, so stop with the step, the scale and the fixes."""
        scaler, o = self.opt.scaler, self.cfg.optimizer
        scale = info.get("loss_scale")
        floor, ran_at = (scaler.min_scale if scaler.dynamic else scale), info.get("step_loss_scale", scale)
        at_floor = bool(info.get("skipped")) and scale is not None and ran_at <= floor
        self._skips_at_floor = getattr(self, "_skips_at_floor", 0) + 1 if at_floor else 0
        if self._skips_at_floor >= self.MAX_SKIPS_AT_MIN_SCALE:
            self._check_finite()  # a NaN loss explains the overflows: report it first
            loss = host_sync.read(loss, "log", placeholder=0.0)
            where, cure = ((f"the minimum loss scale {scale:g} (optimizer.min_loss_scale={o.min_loss_scale:g}",
                            "lower optimizer.min_loss_scale") if scaler.dynamic else
                           (f"the static loss scale {scale:g} (optimizer.loss_scale={o.loss_scale:g}",
                            "lower optimizer.loss_scale, or set it to 0 for dynamic scaling"))
            raise TrainingStopped(
                f"gradient overflow storm: {self._skips_at_floor} consecutive steps up to step {self.step + 1} "
                f"overflowed (inf/NaN gradients; loss {loss:.4g}) and were skipped at {where}, "
                f"training.precision={self.cfg.training.precision}); consumed samples {self.consumed}. Fix: lower "
                f"optimizer.lr or optimizer.clip_grad, use training.precision=bf16, or {cure}; then resume from "
                f"the last checkpoint")

    # the loop --------------------------------------------------------------------------------
    def train_step(self) -> dict:
        """One global batch: ``loss`` (the DP mean) and ``grad_norm`` are 0-dim device tensors.
        Raises ``TrainingStopped`` at a log step (or the last) if a loss so far was non-finite."""
        cfg, t = self.cfg, self.cfg.training
        # the schedule is at the number of updates applied: an fp16 step skipped for overflow does
        # not advance it, as DeepSpeed and Megatron step their schedulers only after an update
        updates = self.opt.updates
        lr, betas = lr_at(updates, cfg.optimizer, t.train_steps), betas_at(updates, cfg.optimizer)
        self.opt.set_lr(lr, betas)
        self._inject_faults(self.step + 1)  # test hook: no-op unless ZEROTRON_FAULT is set
        data = self.batches.get(self.consumed)  # read ahead in the background (training/batches.py)
        self.memory.begin_step(self.step + 1, self.opt)
        res = run_step(self.model, self.opt, data, self.grid, cfg.parallel.pipeline_schedule,
                       self.phases or self.memory)
        if self.phases is not None:
            self.phases.step_done()
        info = res.info
        loss = res.loss_sum if res.dp_reduced else self._dp_mean(res.loss_sum)
        self._watch_loss(loss, info.get("grad_norm"))
        self._check_overflow_storm(info, loss)  # stop instead of skipping steps forever
        self.step += 1
        self.consumed += t.global_batch_size
        if step_events.logs(cfg, self.step):
            self._check_finite()
        return {"loss": loss, "lr": lr, "beta1": betas[0], **info}

    def evaluate(self) -> dict:
        """``logging.eval_steps`` global batches of the eval set, forward only (``step.eval_step``)."""
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.env.device)
        steps, batch = self.cfg.logging.eval_steps, self.cfg.training.global_batch_size
        for k in range(steps):
            total = total + eval_step(self.model, self.eval_batches.get(k * batch), self.grid)
        self.model.train()
        loss = host_sync.read(self._dp_mean(total / steps), "eval", placeholder=0.0)  # once per evaluation
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}

    def save(self, wait: bool = True) -> Path:
        """Write a checkpoint of this step (``wait=False`` with async_save: start writing it in the
        background, ``checkpoint/checkpointer.py``); a run whose loss went non-finite raises instead."""
        self._check_finite()
        return self.checkpointer.save(self.step, consumed_samples=self.consumed,
                                      rng_states=self._rng_states(), wait=wait)

    def _stop_agreed(self) -> bool:
        """Whether any rank got SIGTERM, agreed at the steps ``stop_cadence`` picks (read ``"stop"``);
        the flag also carries rank 0's failure to write the run dir and, with a background save in
        flight, whether every writer is done (``_writes_done``): all commit at the same step."""
        writing = self.checkpointer.writing()  # None on every rank alike: no background save in flight
        if not self.stop_cadence.due(host_read_step(self.cfg, self.step, writing is not None)):
            return False
        stop = 2.0 if self.logger.failed else float(self._stop_requested)
        got = self.stop_cadence.agree(self.grid.world_group, self.env.device, stop, writing)
        self._writes_done = writing is not None and got[2] == 0
        if got[0] >= 2:
            run_dir = self.cfg.logging.run_dir
            raise TrainingStopped(self.logger.failed or f"rank 0 cannot write logging.run_dir={run_dir}")
        return got[0] > 0

    def _record(self, out: dict, window: int) -> dict:
        """One metrics.jsonl object: loss, schedule, throughput, memory, comm bytes per step."""
        rec = {"step": self.step, "loss": out["loss"], "lr": out["lr"], "beta1": out["beta1"],
               "grad_norm": out.get("grad_norm"),
               "loss_scale": out.get("loss_scale"), "skipped_steps": self.step - self.opt.updates,  # resumes too
               **self.throughput.read(),
               **self.peaks.read(), "comm_bytes": self.comm.read(window), **self.stragglers.read()}
        rec.update({f"model_state_{k}": v for k, v in self.opt.memory_report().items()})
        if self.phases is not None:  # logging.wall_clock_breakdown: seconds per phase
            rec.update(self.phases.record())
        if self.memory.active:  # this step was measured (MemoryTracker; parallel/memory_tracker.py)
            rec.update(self.memory.record())
        if self.activations is not None:
            act = self.activations.step_report(window)
            rec.update(saved_activation_device_bytes=act["peak_saved_device_bytes"],
                       saved_activation_host_bytes=act["peak_saved_host_bytes"],
                       pa_allgather_bytes=act["pa_allgather_bytes"])
        return host_values(rec)  # loss, grad_norm: one host read for the whole record

    def train(self) -> dict:
        """Run to ``train_steps`` (or a SIGTERM); metrics, wandb and the lock are closed however it ends."""
        try:
            last = self._loop()
            self.run_log.summary(last, self.stopped)
            return last
        except TrainingStopped:  # raised on every rank at the same point: a save in flight commits
            self.checkpointer.finish(self.step)
            raise
        finally:
            self.checkpointer.abandon()  # any other error: the writer finishes its file, nothing commits
            self.logger.close()
            self.run.release_lock()  # the Checkpointer's locks
            self.run.close_loaders()

    def _loop(self) -> dict:
        t, c = self.cfg.training, self.cfg.checkpoint
        last, window = {}, 0
        self.comm = CommWindow(self.grid.stats)  # both windows start with the loop
        self.throughput.restart()
        self.run_log.start()
        while self.step < t.train_steps:
            with self.profiler.step(self.step + 1), self.stragglers.step():  # a trace; busy time
                out = self.train_step()
            self.throughput.step()
            self.logger.progress()
            window += 1
            if step_events.logs(self.cfg, self.step):
                last, window = self._record(out, window), 0
                self.logger.log(last, self.run_log.logged(last))
            if self.eval_ds is not None and step_events.evaluates(self.cfg, self.step):
                with self.throughput.paused(), self.comm.excluded():
                    ev = self.evaluate()
                self.logger.log({"step": self.step, **ev})
                last.update(ev)
            stop = self._stop_agreed()
            path = None
            if self._writes_done:  # every rank's background write is done: commit it now
                with self.throughput.paused(), self.comm.excluded():
                    self.checkpointer.finish(self.step)
            if step_events.saves(self.cfg, self.step) or (c.save and stop):
                with self.throughput.paused(), self.comm.excluded():
                    path = self.save(wait=stop or self.step == t.train_steps)
            if stop:
                self._check_finite()
                self.stopped = True
                self.log(f"[zerotron] SIGTERM: checkpoint written at step {self.step} ({path}); exiting" if path else
                         f"[zerotron] SIGTERM: stopping at step {self.step}; no checkpoint written (checkpoint.save "
                         f"is not set), so this run cannot be resumed from here")
                break
        if c.save and t.train_steps == 0:  # --init-from-hf DIR --train-steps 0: the imported model
            self.save()
        self.checkpointer.finish(self.step)  # a run whose last step saves nothing still commits the one in flight
        return last
