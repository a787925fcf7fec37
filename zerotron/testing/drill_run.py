"""One layout's share of the reliability drill: how its jobs are launched and how a fault is judged.

Every scenario runs the tiny config (seq 64, global batch 4, a checkpoint every 4 steps) in one
layout -- DP only, TP 2 x DP 2, TP 2 x PP 2 or TP 2 x PP 2 x DP 2 -- with a short collective timeout, so a frozen rank
is named in seconds rather than the default ten minutes. What a scenario may compare against is
made once per layout: an uninterrupted 12-step run (``base``), whose checkpoints (steps 8 and 12)
are copied for the resume scenarios and whose losses are the reference of the restart scenario.
Those losses are compared bit for bit, so where the jobs compute on a GPU every job runs with
``training.deterministic`` (fused attention's backward is nondeterministic otherwise); on CPU,
whose kernels are deterministic already, the jobs run as before.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

from zerotron.parallel.runtime import pick_device
from zerotron.testing.drill_job import VICTIM, Job, Layout, complete_steps, losses

COMMON = ("--config", "configs/tiny.yaml", "--micro-batch-size", "2", "--global-batch-size", "4",
          "--seq-length", "64", "--log-interval", "1", "--eval-interval", "0", "--wandb-mode", "disabled",
          "--optimizer.warmup_steps", "2", "--save-interval", "4")
BASE_STEPS = 12
FAULTED_STEPS = 60  # a faulted (or SIGTERMed) run is stopped long before its end
# its resume runs only a few steps past the newest checkpoint: along the faulted run's decay, which
# ends at FAULTED_STEPS (a resume that moved the end would be refused: checkpoint/resume_schedule.py)
KEEP_DECAY = ("--optimizer.schedule_steps", str(FAULTED_STEPS))
NAMED = r"rank (\d+) (?:is dead or frozen|is alive but stuck behind|has no readable heartbeat)"
SAVED = r"\[checkpoint\] saved \S*step_{:08d}"
LOADED = r"\[checkpoint\] loaded \S+ \(step (\d+)"
JOB_S = 300  # no drill job should run longer, even on a loaded machine


class Drill:
    """Launches the jobs of one layout under ``root/<key>`` with ``timeout_s`` as collective timeout."""

    def __init__(self, root: Path, key: str, layout: Layout, timeout_s: float, tmp: Path,
                 nccl_semantics: bool = False):
        self.root, self.key, self.layout, self.timeout_s, self.tmp = root / key, key, layout, timeout_s, tmp
        # ZEROTRON_EMULATE_NCCL: no wait() raises, as under NCCL; the watchdog must name the culprit
        self.env = {"ZEROTRON_COLLECTIVE_TIMEOUT": f"{timeout_s:g}",
                    **({"ZEROTRON_EMULATE_NCCL": "1"} if nccl_semantics else {})}
        self.root.mkdir(parents=True, exist_ok=True)
        self._base: Path | None = None
        # the jobs' device, as pretrain_gpt will pick it (ZEROTRON_DEVICE of this process included)
        on_gpu = pick_device().type == "cuda"
        self.device_flags = ("--training.deterministic", "true") if on_gpu else ()
        self.base_losses: dict[int, float] = {}

    @property
    def survivors(self) -> list[int]:
        return [r for r in range(self.layout.nproc) if r != VICTIM]

    def argv(self, name: str, steps: int, save: Path | str | None = None, *extra: str) -> list[str]:
        from zerotron.config.cli import last_wins  # a scenario's extra flags win

        return last_wins([*COMMON, *self.device_flags, *self.layout.flags,
                          "--train-steps", str(steps), "--run-dir",
                          str(self.root / name / "run"), "--save", str(save) if save else "none",
                          *extra])

    def job(self, argv: list[str], env: dict[str, str] | None = None, torchrun: tuple[str, ...] = ()) -> Job:
        run_dir = Path(argv[argv.index("--run-dir") + 1])
        return Job(self.layout.nproc, argv, {**self.env, **(env or {})},
                   self.tmp, torchrun, log=run_dir.parent / "job.log")

    def run(self, argv: list[str], env: dict[str, str] | None = None, timeout: float = JOB_S) -> tuple[Job, int]:
        job = self.job(argv, env)
        return job, job.wait(timeout)

    # the per-layout reference -------------------------------------------------------------------
    def base(self) -> Path:
        """The save directory of an uninterrupted ``BASE_STEPS`` run (made on first use)."""
        if self._base is None:
            save = self.root / "base" / "ck"
            job, code = self.run(self.argv("base", BASE_STEPS, save))
            if code != 0 or complete_steps(save) != [8, 12]:
                raise RuntimeError(f"{self.layout.name}: the reference run failed (exit {code}, checkpoints "
                                   f"{complete_steps(save)}):\n{job.text()[-3000:]}")
            self._base, self.base_losses = save, losses(self.root / "base" / "run")
        return self._base

    def copy_base(self, name: str) -> Path:
        dst = self.root / name / "ck"
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(self.base(), dst)
        return dst

    # judging ------------------------------------------------------------------------------------
    def resume(self, name: str, save: Path, steps: int, before: int | None,
               extra: tuple[str, ...] = ()) -> tuple[str, bool]:
        """Run the same command (``extra``: its flags) again, ``checkpoint.load=auto``, to ``steps``:
        'none' when it continues from ``before``, the newest complete checkpoint, and finishes."""
        if before is None:
            return "LOST: no complete checkpoint left", False
        job, code = self.run(self.argv(name + "_resume", steps, save, *extra))
        loaded = job.first(LOADED)
        if code != 0 or loaded is None:
            return f"RESUME FAILED (exit {code}): {_last_error(job)}", False
        got = int(re.search(LOADED, loaded[1]).group(1))
        if got != before:
            return f"LOST: resumed from step {got}, the newest complete was {before}", False
        return f"none (resumed from step {before}, ran to {steps})", True

    def blame(self, job: Job, victim: int, t_fault: float) -> tuple[float | None, str, bool]:
        """When ``victim`` was first named (by a watchdog line or a survivor's error), a summary, and
        whether every survivor's error names ``victim`` and no one else."""
        first = next(((t, line) for t, line in job.all(NAMED) if str(victim) in re.findall(NAMED, line)), None)
        errors = {int(m.group(1)): line for _, line in job.all(r"^\[rank (\d+)\] CollectiveError")
                  if (m := re.match(r"^\[rank (\d+)\]", line))}
        survivors = [r for r in range(self.layout.nproc) if r != victim]
        naming = [r for r in survivors if r in errors and set(re.findall(NAMED, errors[r])) == {str(victim)}]
        kinds = sorted({k for line in errors.values() for k in re.findall(
            rf"rank {victim} (?:is )?(dead or frozen|alive but stuck behind|has no readable heartbeat)", line)})
        how = "watchdog" if first and "watchdog" in first[1] else "error"
        text = (f"rank {victim} named by {len(naming)}/{len(survivors)} survivors"
                + (f" ({', '.join(kinds)}; first by the {how})" if kinds else ""))
        return (first[0] - t_fault if first else None), text, len(naming) == len(survivors)

    def short(self, text: str, n: int = 110) -> str:
        """``text`` with the drill's directory written as ``…``, cut to ``n`` characters."""
        for prefix in sorted({str(self.root.parent.resolve()), str(self.root.parent)}, key=len, reverse=True):
            text = text.replace(prefix + "/", "…/")
        return text if len(text) <= n else text[:n - 1] + "…"


def _last_error(job: Job) -> str:
    hit = [line for _, line in job.lines if re.search(r"Error|error:", line)]
    return (hit[-1] if hit else (job.lines[-1][1] if job.lines else "no output"))[:160]


def wait_step(job: Job, step: int, timeout: float = JOB_S) -> float | None:
    """When the job logged ``step`` (its progress line: ``step 6/12 | loss ...``)."""
    return job.wait_for(rf"^step\s+{step}\b", timeout)


def fmt_s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s"


def now() -> float:
    return time.monotonic()
