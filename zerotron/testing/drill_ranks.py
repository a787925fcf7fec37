"""Drill scenarios where a rank fails: killed, frozen, stuck, dead in the middle of a checkpoint --
and a job under ``torchrun --max-restarts 1`` that restarts itself after one.

A survivor must name the failed rank (every survivor, the same rank) and exit 3; a frozen or stuck
rank within the collective timeout + 10 s. Nothing may be lost: the same command resumes from the
newest complete checkpoint (a partial one is skipped), and the restarted job's losses equal an
uninterrupted run's bit for bit.
"""

from __future__ import annotations

import os
import re
import signal
import time

from zerotron.testing.drill_job import VICTIM, Job, Row, complete_steps
from zerotron.testing.drill_run import (BASE_STEPS, FAULTED_STEPS, JOB_S, KEEP_DECAY, LOADED, SAVED,
                                        Drill, now, wait_step)

SLACK_S = 10.0  # a frozen rank must be named within the collective timeout + this


def _await_survivors(d: Drill, job: Job, t_fault: float) -> None:
    """Until every survivor has reported its CollectiveError (or the bound has long passed)."""
    deadline = t_fault + d.timeout_s + SLACK_S + 30
    want = d.layout.nproc - 1
    while now() < deadline and job.proc.poll() is None:
        if len({line.split("]")[0] for _, line in job.all(r"^\[rank \d+\] CollectiveError")}) >= want:
            return
        time.sleep(0.2)


def _judge(d: Drill, job: Job, code: int, victim: int, t_fault: float, frozen: bool, name: str,
           save, resume_to: int | None, extra: tuple[str, ...] = ()) -> Row:
    detect, text, everyone = d.blame(job, victim, t_fault)
    exits = job.worker_exits()
    survivors_3 = all(exits.get(r) == 3 for r in range(d.layout.nproc) if r != victim)
    ok = detect is not None and everyone and survivors_3
    notes = []
    if frozen and detect is not None and detect > d.timeout_s + SLACK_S:
        ok = False
        notes.append(f"named after {detect:.1f} s > timeout {d.timeout_s:g} s + {SLACK_S:g} s")
    if not survivors_3:
        notes.append(f"survivor exit codes {exits}")
    before = (complete_steps(save) or [None])[-1]
    partial = sorted(p.name for p in save.glob("*.tmp")) if save.exists() else []
    lost, resumed = d.resume(name, save, resume_to or (before or 0) + 4, before, extra)
    if partial:
        lost += f"; partial {', '.join(partial)} skipped"
    return Row(text, detect, job.exit_text(code), lost, ok and resumed, notes)


def signal_rank(d: Drill, name: str, sig: int) -> Row:
    """``sig`` (SIGKILL or SIGSTOP) to rank 1 from outside, right after the step-4 checkpoint."""
    save = d.root / name / "ck"
    job = d.job(d.argv(name, FAULTED_STEPS, save))
    if job.wait_for(SAVED.format(4), JOB_S) is None or wait_step(job, 5, 60) is None:
        job.kill()
        return Row(f"DRILL FAILED: the job never reached step 5 (exit {job.wait(10)})", None, "-", "-", False)
    pid = job.worker_pid(VICTIM)
    t_fault = now()
    os.kill(pid, sig)
    _await_survivors(d, job, t_fault)
    if sig == signal.SIGSTOP:  # the verdict is in: do not wait for torchrun's grace period on a stopped rank
        for s in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.kill(pid, s)
            except ProcessLookupError:
                break
    code = job.wait(120)
    return _judge(d, job, code, VICTIM, t_fault, sig == signal.SIGSTOP, name, save, None,
                  KEEP_DECAY)


def stall_rank(d: Drill, name: str = "stall") -> Row:
    """Rank 1 stops issuing collectives at step 6 while its heartbeat goes on: "alive but stuck"."""
    save = d.root / name / "ck"
    stall_s = d.timeout_s + SLACK_S + 30
    job = d.job(d.argv(name, FAULTED_STEPS, save), {"ZEROTRON_FAULT": f"stall@step=6@rank={VICTIM}",
                                         "ZEROTRON_FAULT_STALL_S": f"{stall_s:g}"})
    t_fault = job.wait_for(r"\[fault\] rank \d+: injected stall", JOB_S)
    if t_fault is None:
        job.kill()
        return Row(f"DRILL FAILED: the stall was never injected (exit {job.wait(10)})", None, "-", "-", False)
    _await_survivors(d, job, t_fault)
    try:  # the stalled rank would sleep on (torchrun's SIGTERM only sets its stop flag); its verdict is in
        os.kill(job.worker_pid(VICTIM), signal.SIGKILL)
    except (RuntimeError, ProcessLookupError):
        pass
    code = job.wait(120)
    return _judge(d, job, code, VICTIM, t_fault, True, name, save, None, KEEP_DECAY)


def crash_in_save(d: Drill, name: str, fault: str, victim: int) -> Row:
    """A rank dies inside the step-8 save (``kill_after_shard``: after its shard; ``kill_before_commit``:
    rank 0, metadata written, not renamed): step 8 stays a ``.tmp``, step 4 must resume."""
    save = d.root / name / "ck"
    job = d.job(d.argv(name, BASE_STEPS, save), {"ZEROTRON_FAULT": f"{fault}@step=8@rank={victim}"})
    t_fault = job.wait_for(r"\[fault\] rank \d+: injected", JOB_S)
    if t_fault is None:
        job.kill()
        return Row(f"DRILL FAILED: the fault was never injected (exit {job.wait(10)})", None, "-", "-", False)
    _await_survivors(d, job, t_fault)
    code = job.wait(120)
    return _judge(d, job, code, victim, t_fault, False, name, save, BASE_STEPS)


def kill_in_background_write(d: Drill, name: str = "async_kill9") -> Row:
    """``checkpoint.async_save``: rank 1's writer thread is held before writing its step-8 shard
    (``hold_writer``) while the loop trains on, and the drill kills rank 1 (SIGKILL) then. Step 8
    stays a ``.tmp``; step 4, written in the background too, must verify and resume."""
    save, flags = d.root / name / "ck", ("--checkpoint.async_save", "true")
    job = d.job(d.argv(name, BASE_STEPS, save, *flags), {"ZEROTRON_FAULT": f"hold_writer@step=8@rank={VICTIM}"})
    if job.wait_for(r"\[fault\] rank \d+: injected hold_writer", JOB_S) is None:
        job.kill()
        return Row(f"DRILL FAILED: the writer was never held (exit {job.wait(10)})", None, "-", "-", False)
    t_fault = now()
    os.kill(job.worker_pid(VICTIM), signal.SIGKILL)
    _await_survivors(d, job, t_fault)
    code = job.wait(120)
    return _judge(d, job, code, VICTIM, t_fault, False, name, save, BASE_STEPS, flags)


def restart(d: Drill, name: str = "restart") -> Row:
    """``torchrun --max-restarts 1``; kill -9 of rank 1 at step 6. The job must restart by itself,
    resume from step 4 (``checkpoint.load=auto``) and log the same losses as the uninterrupted
    reference, bit for bit."""
    d.base()
    save = d.root / name / "ck"
    job = d.job(d.argv(name, BASE_STEPS, save), torchrun=("--max-restarts", "1"))
    if job.wait_for(SAVED.format(4), JOB_S) is None or wait_step(job, 6, 60) is None:
        job.kill()
        return Row(f"DRILL FAILED: the job never reached step 6 (exit {job.wait(10)})", None, "-", "-", False)
    t_fault = now()
    os.kill(job.worker_pid(VICTIM), signal.SIGKILL)
    code = job.wait(JOB_S)
    detect, text, everyone = d.blame(job, VICTIM, t_fault)
    loaded = job.first(LOADED)
    resumed = int(re.search(LOADED, loaded[1]).group(1)) if loaded else None
    from zerotron.testing.drill_job import losses

    got, ref = losses(d.root / name / "run"), d.base_losses
    after = [s for s in range(1, BASE_STEPS + 1) if resumed is not None and s > resumed]
    same = [s for s in after if s in got and got[s] == ref.get(s)]
    ok = code == 0 and resumed == 4 and after and len(same) == len(after) and detect is not None
    t_back = (loaded[0] - t_fault) if loaded else None
    detected = f"{text}; restarted, resumed step {resumed}" + (f" {t_back:.0f} s after the kill" if t_back else "")
    if ok:
        lost = f"none (steps {after[0]}-{after[-1]}: losses bit-identical to the uninterrupted run)"
    else:
        diff = [f"step {s}: {got.get(s)} vs {ref.get(s)}" for s in after if s not in same][:3]
        lost = f"LOST/DIFFERENT: resumed {resumed}, {len(same)}/{len(after)} steps identical {diff}"
    notes = [] if everyone else ["not every survivor named rank 1"]
    return Row(detected, detect, job.exit_text(code), lost, bool(ok), notes)
