"""Reliability drill: inject faults into real multi-process runs (torchrun) and check nothing is lost.

    .venv/bin/python scripts/drill.py                 # every scenario, 2 ranks, tiny config
    .venv/bin/python scripts/drill.py --nproc 4 --only kill9,sigstop

Each scenario launches ``torchrun scripts/pretrain_gpt.py`` on the tiny config, injects one fault
-- a rank killed with SIGKILL or frozen with SIGSTOP from outside, a writer crash in the middle
of a checkpoint, an fp16 overflow storm, a NaN loss, a truncated .bin, a corrupt .idx, a
tokenizer larger than the model's vocabulary -- and records how the job ended, how long the
fault took to be detected (fault -> job exit), and whether data was lost: after the fault the
newest complete checkpoint must load and a resumed run must continue from it to the end. In-process
faults use the ``ZEROTRON_FAULT`` test hook (zerotron/training/faults.py). Prints a table; exits 1
if any scenario lost data or ended unexpectedly.

Everything it writes -- run and checkpoint directories, the corrupted corpus copies, torchrun's
own temporary files (``TMPDIR``) -- goes to a fresh directory under ``--out`` (default
``runs/drill``), removed at the end unless ``--keep``; never the system temp dir.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PY = Path(sys.executable)
TORCHRUN = PY.parent / "torchrun"
COMMON = ["--config", "configs/tiny.yaml", "--tp", "1", "--micro-batch-size", "2", "--global-batch-size", "4",
          "--seq-length", "64", "--log-interval", "1", "--eval-interval", "0", "--wandb-mode", "disabled",
          "--optimizer.warmup_steps", "2", "--save", "none"]


class Job:
    """A torchrun job whose output lines are timestamped as they arrive."""

    tmp: Path | None = None  # TMPDIR of every job (main sets it inside the drill's directory)

    def __init__(self, nproc: int, argv: list[str], env: dict[str, str] | None = None):
        cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node", str(nproc), "scripts/pretrain_gpt.py", *argv]
        self.start = time.monotonic()
        self.lines: list[tuple[float, str]] = []
        env = {**os.environ, **({"TMPDIR": str(self.tmp)} if self.tmp else {}), **(env or {})}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip()))

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            code = -9
        self._reader.join(timeout=5)
        self.end = time.monotonic()
        return code

    def wait_for(self, pattern: str, timeout: float) -> float | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            for t, line in list(self.lines):
                if re.search(pattern, line):
                    return t
            time.sleep(0.1)
        return None

    def first(self, pattern: str) -> tuple[float, str] | None:
        return next(((t, l) for t, l in self.lines if re.search(pattern, l)), None)

    def text(self) -> str:
        return "\n".join(l for _, l in self.lines)

    def worker_pid(self, rank: int) -> int:
        """The pid of the training process of ``rank`` (a child of torchrun with RANK=rank)."""
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            if ppid == self.proc.pid and f"RANK={rank}".encode() in env:
                return int(pid)
        raise RuntimeError(f"no worker with RANK={rank} under torchrun {self.proc.pid}")


def newest_complete(save: Path) -> int | None:
    steps = [int(p.name[5:]) for p in save.glob("step_*") if p.name[5:].isdigit() and (p / "metadata.json").is_file()]
    return max(steps) if steps else None


def resume_check(nproc: int, save: Path, run_dir: Path, steps: int, before: int | None) -> str:
    """Resume from ``save``; 'none' when it continues from the newest complete checkpoint to the end."""
    if before is None:
        return "n/a (no checkpoint yet)"
    job = Job(nproc, COMMON + ["--train-steps", str(steps), "--run-dir", str(run_dir), "--save", str(save),
                               "--save-interval", "5", "--load", str(save)])
    code = job.wait(240)
    loaded = re.search(r"\[checkpoint\] loaded \S+ \(step (\d+)", job.text())
    if code != 0 or not loaded:
        return f"RESUME FAILED (exit {code})"
    if int(loaded.group(1)) != before:
        return f"LOST: resumed from step {loaded.group(1)}, newest complete was {before}"
    return f"none (resumed at step {before}, ran to {steps})"


def signal_scenario(name: str, sig: int, nproc: int, root: Path) -> tuple[str, str, str]:
    save, steps = root / name / "ck", 40
    env = {"ZEROTRON_COLLECTIVE_TIMEOUT": "10"}
    job = Job(nproc, COMMON + ["--train-steps", str(steps), "--run-dir", str(root / name / "a"), "--save", str(save),
                               "--save-interval", "5"], env)
    if job.wait_for(r"saved .*step_00000005", 180) is None:
        job.wait(1)
        return "DRILL FAILED (no checkpoint)", "-", "-"
    victim = job.worker_pid(1)
    t_fault = time.monotonic()
    os.kill(victim, sig)
    code = job.wait(120)
    if sig == signal.SIGSTOP:  # torchrun SIGKILLs it eventually; make sure nothing is left frozen
        for s in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.kill(victim, s)
            except ProcessLookupError:
                break
    named = job.first(r"CollectiveError: .*rank 1 ")
    detect = (named[0] if named else job.end) - t_fault
    outcome = f"exit {code}; " + ("survivors named rank 1" if named else "rank 1 NOT named")
    if named:
        why = re.search(r"rank 1 (is dead or frozen|is alive but stuck behind|has no readable heartbeat)", named[1])
        outcome += f" ({why.group(1) if why else 'named'})"
    before = newest_complete(save)
    return outcome, f"{detect:.1f}s (job down {job.end - t_fault:.1f}s)", \
        resume_check(nproc, save, root / name / "b", steps=before + 5, before=before)


def fault_scenario(name: str, fault: str, nproc: int, root: Path, extra: list[str], expect: str,
                   resume: bool) -> tuple[str, str, str]:
    save, steps = root / name / "ck", 12
    job = Job(nproc, COMMON + ["--train-steps", str(steps), "--run-dir", str(root / name / "a"), "--save", str(save),
                               "--save-interval", "4", *extra], {"ZEROTRON_FAULT": fault} if fault else {})
    code = job.wait(240)
    injected = job.first(r"\[fault\]")
    t0 = injected[0] if injected else job.start
    hit = job.first(expect)
    outcome = f"exit {code}; " + (hit[1].split("] ", 1)[-1][:90] if hit else f"EXPECTED /{expect}/ NOT SEEN")
    detect = f"{job.end - t0:.1f}s" + ("" if injected else " (from launch)")
    lost = "none (refused at start-up)"
    if resume:
        before = newest_complete(save)
        partial = sorted(p.name for p in save.glob("*.tmp")) if save.exists() else []
        lost = resume_check(nproc, save, root / name / "b", steps=steps, before=before)
        if partial:
            lost += f"; skipped partial {', '.join(partial)}"
    elif save.exists() and newest_complete(save):
        lost = f"none (stopped; newest checkpoint step {newest_complete(save)} intact)"
    return outcome, detect, lost


def corrupt_corpus(root: Path) -> Path:
    """A copy of the built-in corpus (built by the first scenario) to break in various ways."""
    src = next((ROOT / ".cache/zerotron").glob("stdlib-*"))
    dst = root / "corpus"
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("train.bin", "train.idx", "tokenizer.model"):
        shutil.copy(src / name, dst / name)
    for kind in ("truncated", "badidx"):
        for ext in (".bin", ".idx"):
            shutil.copy(dst / f"train{ext}", dst / f"{kind}{ext}")
    with open(dst / "truncated.bin", "r+b") as f:
        f.truncate(os.path.getsize(dst / "truncated.bin") - 100)
    head = np.fromfile(dst / "badidx.idx", np.uint8, 48)
    n_docs = int(head[32:40].view(np.uint64)[0])
    idx = np.memmap(dst / "badidx.idx", np.uint8, "r+")
    sizes = idx[48 + 8 * (n_docs + 1):48 + 8 * (n_docs + 1) + 4 * n_docs].view(np.int32)
    sizes[n_docs // 2] += 3
    idx.flush()
    return dst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    ap.add_argument("--out", default=str(ROOT / "runs" / "drill"), help="where the drill's directory is made")
    ap.add_argument("--keep", action="store_true", help="keep the drill's run directories")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="drill_", dir=args.out))
    (root / "tmp").mkdir()
    Job.tmp = root / "tmp"  # torchrun's and the workers' temporary files stay in the drill's directory
    n = args.nproc

    def data(kind: str, extra: list[str]):
        c = corrupt_corpus(root)
        argv = ["--data.tokenizer", str(c / "tokenizer.model"), "--data.data_path", str(c / kind), *extra]
        return fault_scenario(f"data_{kind}", "", n, root, argv, r"config error: .*(data\.|model\.vocab_size)", False)

    scenarios = {
        "kill9": ("rank 1 SIGKILLed mid-run", lambda: signal_scenario("kill9", signal.SIGKILL, n, root)),
        "sigstop": ("rank 1 SIGSTOPped mid-run", lambda: signal_scenario("sigstop", signal.SIGSTOP, n, root)),
        "ckpt_crash": ("rank 1 killed mid-checkpoint (after its shard)", lambda: fault_scenario(
            "ckpt_crash", "kill_after_shard@step=8@rank=1", n, root, [], r"CollectiveError", True)),
        "commit_crash": ("rank 0 killed before the checkpoint rename", lambda: fault_scenario(
            "commit_crash", "kill_before_commit@step=8@rank=0", n, root, [], r"CollectiveError", True)),
        "overflow": ("fp16 overflow storm at the scale floor", lambda: fault_scenario(
            "overflow", "", n, root, ["--precision", "fp16", "--optimizer.initial_loss_scale", "4294967296",
                                      "--optimizer.min_loss_scale", "4294967296", "--optimizer.hysteresis", "1"],
            r"overflow storm", False)),
        "nan": ("NaN weight at step 6 (bf16)", lambda: fault_scenario(
            "nan", "nan@step=6", n, root, ["--precision", "bf16"], r"loss is nan at step 6", True)),
        "truncated_bin": ("truncated .bin", lambda: data("truncated", [])),
        "bad_idx": (".idx sizes do not match", lambda: data("badidx", [])),
        "vocab": ("tokenizer vocab > model.vocab_size", lambda: data("train", ["--model.vocab_size", "512"])),
    }
    chosen = [s for s in args.only.split(",") if s] or list(scenarios)
    rows, ok = [], True
    for key in chosen:
        desc, fn = scenarios[key]
        print(f"[drill] {key}: {desc} ...", flush=True)
        t = time.monotonic()
        outcome, detect, lost = fn()
        ok &= lost.startswith("none") or lost.startswith("n/a")
        ok &= "NOT" not in outcome and "FAILED" not in outcome
        rows.append((key, desc, outcome, detect, lost))
        print(f"[drill] {key}: done in {time.monotonic() - t:.0f}s", flush=True)
    header = ("scenario", "fault", "outcome", "time to detect", "data lost")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(5)]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"[drill] run directories kept under {root}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
