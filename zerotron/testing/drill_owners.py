"""Drill scenarios about who owns a checkpoint directory and what a resume may do: a second run on
a held directory, a corrupt newest checkpoint, a resume that changes the schedule, a run already
complete, and a SIGTERM with and without a checkpoint directory.

Each resume scenario starts from a copy of the layout's reference checkpoints (steps 8 and 12).
A refusal must come before any training (exit 2, naming the field or the holder); the first
run's checkpoints must stay intact; every message must be true of what is on disk.
"""

from __future__ import annotations

import json
import re
import signal

from zerotron.testing.drill_job import Row, complete_steps, intact
from zerotron.testing.drill_run import (FAULTED_STEPS, JOB_S, KEEP_DECAY, LOADED, SAVED, Drill, now,
                                        wait_step)

# A refusal in preflight may cost this much beyond a bare launch of the same layout measured at
# the same moment. The launch itself -- torchrun's import of torch, then each worker's -- is what
# took 19.6 s at a load average of 20 (about 10 s per import), not the lock check (< 1 s).
REFUSAL_OVER_LAUNCH_S = 5.0


def bare_launch_s(d: Drill, name: str) -> float:
    """Seconds ``--help`` takes through the same launcher and layout, now: the part of a refusal's
    time no check can save (torchrun, Python and torch start-up), measured beside it."""
    job = d.job(d.argv(name + "_bare_launch", 1, None, "--help"))
    job.wait(JOB_S)
    return job.end - job.start


def _judge_time(took: float, bare: float) -> tuple[bool, str]:
    """Whether a refusal ``took`` s after launch is fast for what it does, and words saying so."""
    over = took - bare
    than = f"{over:.1f} s more" if over >= 0 else f"{-over:.1f} s less"  # start-up varies with load
    words = f"; a bare launch (--help) took {bare:.1f} s, the refusal {than}"
    if over >= REFUSAL_OVER_LAUNCH_S:
        words += f" [>= {REFUSAL_OVER_LAUNCH_S:g} s over the launch]"
    return over < REFUSAL_OVER_LAUNCH_S, words
FIRST_STEPS = 16  # the first run pauses at step 6 (ZEROTRON_FAULT=pause) until the second has ended


def second_run(d: Drill, name: str = "lock") -> Row:
    """Two runs on one ``--save``: the second must exit 2 naming the first (host and pid), in
    less than ``REFUSAL_OVER_LAUNCH_S`` beyond a bare launch;
    the first must finish with all its checkpoints intact. The first holds at the start of step 6
    (``pause``, every rank) until the second has ended, so it is still running however fast it trains."""
    save, release = d.root / name / "ck", d.root / name / "release"
    first = d.job(d.argv(name + "_first", FIRST_STEPS, save), {
        "ZEROTRON_FAULT": "pause@step=6", "ZEROTRON_FAULT_PAUSE_FILE": str(release), "ZEROTRON_FAULT_STALL_S": "600"})
    if first.wait_for(SAVED.format(4), JOB_S) is None or first.wait_for(r"\[fault\] .*pause", 60) is None:
        first.kill()
        return Row(f"DRILL FAILED: the first run never saved (exit {first.wait(10)})", None, "-", "-", False)
    holder = first.worker_pid(0)
    second = d.job(d.argv(name + "_second", FIRST_STEPS, save))
    code2 = second.wait(JOB_S)
    bare = bare_launch_s(d, name)  # while the first run still holds: the same load
    release.write_text("")  # the first run goes on from step 6 to the end
    refusal = second.first(r"in use by another run")
    took = (refusal[0] if refusal else second.end) - second.start
    names_holder = bool(refusal and f"pid {holder}," in refusal[1])
    code1 = first.wait(JOB_S)
    steps, problems = intact(save)
    want = [FIRST_STEPS - 4, FIRST_STEPS]  # keep_last 2
    ok1 = code1 == 0 and steps == want and not problems and not second.first(r"\[checkpoint\] saved")
    fast, timing = _judge_time(took, bare)
    ok = names_holder and second.exited(2) and fast and ok1
    text = (f"second run refused before init_process_group, naming the holder (host, pid {holder}); "
            f"exited {second.end - second.start:.1f} s after launch" if names_holder
            else "second run NOT refused naming the holder") + timing
    lost = (f"none (first run finished: step_{want[0]}, step_{want[1]} verified)" if ok1 else
            f"FIRST RUN HURT: exit {code1}, checkpoints {steps} {problems[:2]}")
    return Row(text, took, f"{second.exit_text(code2)}; first 0" if code1 == 0 else f"first {code1}", lost, ok)


def second_run_dir(d: Drill, name: str = "run_dir") -> Row:
    """Two runs in one ``--run-dir`` without checkpoints: the second must exit 2 naming the first
    (``logging.run_dir``, host and pid) within ``REFUSAL_OVER_LAUNCH_S`` of a bare launch, before
    touching its ``config.yaml`` or
    ``metrics.jsonl``; the first must finish with one metrics record per step."""
    release = d.root / name / "release"
    argv = d.argv(name, FIRST_STEPS, None, "--log-interval", "1")
    first = d.job(argv, {"ZEROTRON_FAULT": "pause@step=6", "ZEROTRON_FAULT_STALL_S": "600",
                         "ZEROTRON_FAULT_PAUSE_FILE": str(release)})
    if first.wait_for(r"\[fault\] .*pause", JOB_S) is None:
        first.kill()
        why = f"DRILL FAILED: the first run never paused (exit {first.wait(10)})"
        return Row(why, None, "-", "-", False)
    holder = first.worker_pid(0)
    run_dir = d.root / name / "run"
    config = (run_dir / "config.yaml").read_text()
    second = d.job(argv[:-2] + ["--lr", "0.001", "--log-interval", "1"])  # another run, same dir
    code2 = second.wait(JOB_S)
    bare = bare_launch_s(d, name)  # while the first run still holds: the same load
    same_config = (run_dir / "config.yaml").read_text() == config
    release.write_text("")
    refusal = second.first(r"logging\.run_dir=.* is in use by another run")
    took = (refusal[0] if refusal else second.end) - second.start
    names_holder = bool(refusal and f"pid {holder}," in refusal[1])
    code1 = first.wait(JOB_S)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line).get("step") for line in lines]
    ok1 = code1 == 0 and steps == list(range(1, FIRST_STEPS + 1)) and same_config
    fast, timing = _judge_time(took, bare)
    ok = names_holder and second.exited(2) and fast and ok1
    text = (f"second run refused before init_process_group, naming logging.run_dir and the holder "
            f"(pid {holder})" if names_holder else "second run NOT refused naming the holder")
    text += timing
    lost = (f"none (config.yaml unchanged, metrics.jsonl steps 1..{FIRST_STEPS})" if ok1 else
            f"FIRST RUN HURT: exit {code1}, config kept {same_config}, steps {steps[:3]}..")
    return Row(text, took, f"{second.exit_text(code2)}; first {code1}", lost, ok)


def corrupt_newest(d: Drill, name: str = "corrupt_newest") -> Row:
    """Flip bytes in step 12's shard: refused naming it and the intact step 8, which
    ``--checkpoint.fallback true`` then loads."""
    save = d.copy_base(name)
    shard = save / "step_00000012" / "rank_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2:len(data) // 2 + 16] = bytes(16)
    shard.write_bytes(bytes(data))
    keep = ("--optimizer.schedule_steps", "12")  # 16 steps along the reference's decay (ends at 12)
    job = d.job(d.argv(name, 16, save, *keep))
    code = job.wait(JOB_S)
    said = job.first(r"step_00000012 is corrupt.*step_00000008, is intact \(verified\).*--checkpoint\.fallback true")
    again = d.job(d.argv(name + "_fallback", 16, save, *keep, "--checkpoint.fallback", "true"))
    code2 = again.wait(JOB_S)
    loaded = again.first(LOADED)
    step = int(re.search(LOADED, loaded[1]).group(1)) if loaded else None
    ok = bool(said) and job.exited(2) and code2 == 0 and step == 8
    text = ("step_00000012 named corrupt, step_00000008 named intact; refused without --checkpoint.fallback"
            if said else "corrupt checkpoint NOT named with the one before it")
    lost = ("none beyond the corrupt step 12 (fallback loaded step 8, ran to 16)" if code2 == 0 and step == 8
            else f"FALLBACK FAILED (exit {code2}, loaded {step})")
    return Row(text, (said[0] - job.start) if said else None, job.exit_text(code), lost, ok)


def changed_schedule(d: Drill, name: str, flags: list[str], field: str) -> Row:
    """Resume the reference with another lr or global batch: refused naming ``field``, accepted with
    ``--checkpoint.override_schedule true``."""
    save = d.copy_base(name)
    job = d.job(d.argv(name, 16, save, *flags))
    code = job.wait(JOB_S)
    said = job.first(rf"would change its run's schedule: {re.escape(field)}=")
    again = d.job(d.argv(name + "_override", 16, save, *flags, "--checkpoint.override_schedule", "true"))
    code2 = again.wait(JOB_S)
    loaded = again.first(LOADED)
    ok = bool(said) and job.exited(2) and code2 == 0 and loaded is not None
    text = (f"refused naming {field} (checkpoint's and this run's values); override accepted" if said
            else f"change of {field} NOT refused")
    lost = "none (nothing trained when refused; checkpoints untouched)" if complete_steps(save) else "LOST"
    return Row(text, (said[0] - job.start) if said else None, f"{job.exit_text(code)}; override {code2}", lost, ok)


def already_done(d: Drill, name: str = "already_done") -> Row:
    """``--train-steps 12`` against a checkpoint at step 12: says so and exits 0."""
    save = d.copy_base(name)
    job = d.job(d.argv(name, 12, save))
    code = job.wait(JOB_S)
    said = job.first(r"already complete at step 12")
    ok = bool(said) and code == 0 and not job.first(r"^step\s+\d+") and complete_steps(save) == [8, 12]
    text = d.short(said[1].split("] ", 1)[-1], 130) if said else "NO MESSAGE"
    return Row(text, (said[0] - job.start) if said else None, job.exit_text(code), "none (nothing trained or written)",
               ok)


def sigterm(d: Drill, name: str, with_save: bool) -> Row:
    """SIGTERM to every training rank at step 6, as SLURM preempts a job step (torchrun kept out of it,
    as scripts/slurm/pretrain_gpt.sbatch does: it would SIGKILL the ranks 30 s later): with a directory
    the message names the checkpoint written, and it resumes; without, it says none was written."""
    save = d.root / name / "ck" if with_save else None
    job = d.job(d.argv(name, FAULTED_STEPS, save))  # stopped at 6 or 7
    if wait_step(job, 6) is None:
        job.kill()
        return Row(f"DRILL FAILED: the job never reached step 6 (exit {job.wait(10)})", None, "-", "-", False)
    t_fault = now()
    job.signal_workers(signal.SIGTERM)
    code = job.wait(JOB_S)
    written = job.first(r"SIGTERM: checkpoint written at step (\d+) \((\S+)\)")
    none = job.first(r"SIGTERM: stopping at step \d+; no checkpoint written")
    hit = written or none
    detect = (hit[0] - t_fault) if hit else None
    if with_save:
        step = int(re.search(r"step (\d+)", written[1]).group(1)) if written else None
        true = step is not None and step in complete_steps(save)
        lost, resumed = (d.resume(name, save, (step or 0) + 2, step, KEEP_DECAY) if true
                         else ("LOST: no such checkpoint", False))
        ok = true and resumed and not none
        text = (f"'checkpoint written at step {step}' (it is there, complete)" if true
                else "NO TRUE 'checkpoint written' MESSAGE")
    else:
        left = sorted(p.name for p in (d.root / name).rglob("step_*"))
        ok = bool(none) and not written and not left
        text = ("'no checkpoint written (checkpoint.save is not set)' (none is there)" if ok
                else f"UNTRUE OR MISSING MESSAGE (checkpoints found: {left})")
        lost = "n/a (no checkpoint.save: nothing to keep, as the message says)"
    ok = ok and code == 0
    return Row(text, detect, job.exit_text(code), lost, ok)
