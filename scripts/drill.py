"""Reliability drill: inject faults into real multi-process runs (torchrun) and check nothing is lost.

    .venv/bin/python scripts/drill.py                          # 25 scenarios x 5 layouts
    # (~35 min on 2 cores for the first three, ~15 min for TP 2 x CP 2; the 8-rank one more)
    .venv/bin/python scripts/drill.py --only kill9,sigstop --layouts tp2xpp2
    .venv/bin/python scripts/drill.py --only kill9,sigstop --layouts tp2xdp2,tp2xpp2 --nccl-semantics
    .venv/bin/python scripts/drill.py --list

Each scenario launches ``torchrun scripts/pretrain_gpt.py`` on the tiny config in one of five
layouts -- DP only (``--nproc`` ranks), TP 2 x DP 2, TP 2 x PP 2 and TP 2 x CP 2 (4 ranks; CP's
ring exchanges inside every attention layer), TP 2 x PP 2 x DP 2 (8 ranks: DP inside the pipeline,
one micro-batch per step) -- injects one fault and records whether it was detected (named: the
rank, the field, the file, the step, the lock holder), how long that took (fault -> the line that
names it; launch -> refusal for start-up errors), the exit code (the workers', then torchrun's) and
whether data was lost: after the fault the newest complete checkpoint must verify and the same
command must resume from it to the end. The faults: a rank killed (SIGKILL), frozen (SIGSTOP) or
stuck; a writer dying in the middle of a checkpoint; ``torchrun --max-restarts 1`` restarting
itself after a kill -9 (losses bit-identical to an uninterrupted run); an fp16 overflow storm; a
NaN loss; a full disk during a save (one rank's, injected with ``ZEROTRON_FAULT=enospc``, and a
real one: a small tmpfs, which needs root); broken token files; an oversized tokenizer; a read-only
save directory; bad config values; a second run on a held save directory or run directory; token
ids past the vocabulary; a corrupt newest checkpoint; a resume with another lr or global batch; a
run already complete; SIGTERM with and without a save directory.
Collectives time out after ``--timeout`` s (``ZEROTRON_COLLECTIVE_TIMEOUT``); a frozen rank must
be named within that + 10 s. Prints one line per scenario as it ends, then the table; exits 1 if
any scenario went undetected or lost data.

Everything it writes -- run and checkpoint directories, corrupted corpus copies, torchrun's
temporary files (``TMPDIR``) -- goes to a fresh directory under ``--out`` (default
``runs/drill``), removed at the end unless ``--keep``; never the system temp dir.
"""

from __future__ import annotations

import argparse
import functools
import signal
import sys
import shutil
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the zerotron of this checkout, as the drill's jobs use

from zerotron.testing import drill_inputs as I  # noqa: E402
from zerotron.testing import drill_owners as O  # noqa: E402
from zerotron.testing import drill_ranks as R  # noqa: E402
from zerotron.testing.bench_args import check_out_dir, positive_float  # noqa: E402
from zerotron.testing.drill_job import Row, layouts  # noqa: E402
from zerotron.testing.drill_run import Drill, fmt_s  # noqa: E402

P = functools.partial
SCENARIOS = {  # key: (what is done, how)
    "kill9": ("rank 1 SIGKILLed after the step-4 checkpoint", P(R.signal_rank, name="kill9", sig=signal.SIGKILL)),
    "sigstop": ("rank 1 SIGSTOPped (frozen) after the step-4 checkpoint",
                P(R.signal_rank, name="sigstop", sig=signal.SIGSTOP)),
    "stuck": ("rank 1 stops issuing collectives at step 6 (heartbeat alive)", R.stall_rank),
    "ckpt_crash": ("rank 1 dies mid-checkpoint, after writing its shard",
                   P(R.crash_in_save, name="ckpt_crash", fault="kill_after_shard", victim=1)),
    "commit_crash": ("rank 0 dies after metadata.json, before the rename",
                     P(R.crash_in_save, name="commit_crash", fault="kill_before_commit", victim=0)),
    "async_kill9": ("async_save: rank 1 SIGKILLed while its step-8 background write is in flight",
                    R.kill_in_background_write),
    "restart": ("torchrun --max-restarts 1, kill -9 of rank 1 at step 6", R.restart),
    "overflow": ("fp16 overflow storm at the minimum loss scale", I.overflow),
    "nan": ("NaN weight at step 6 (bf16)", I.nan),
    "enospc": ("disk full on the last rank during the step-8 save (injected)", I.enospc_rank),
    "disk_full": ("real full disk during the step-8 save (tmpfs)", I.disk_full),
    "truncated_bin": ("truncated .bin", P(I.data_fault, name="truncated_bin", prefix="truncated",
                                          field=r"data\.data_path")),
    "bad_idx": (".idx sizes do not match its offsets", P(I.data_fault, name="bad_idx", prefix="badidx",
                                                         field=r"data\.data_path.*corrupt")),
    "vocab": ("tokenizer bigger than model.vocab_size", P(I.data_fault, name="vocab", prefix="train",
                                                          field=r"model\.vocab_size",
                                                          extra=("--model.vocab_size", "512"))),
    "bad_config": ("bad config values (8 cases)", I.bad_config),
    "read_only": ("checkpoint.save on a read-only file system", I.read_only),
    "lock": ("second run on the same checkpoint.save while the first trains", O.second_run),
    "run_dir": ("second run in the same logging.run_dir (no checkpoints) while the first trains",
                O.second_run_dir),
    "oov": ("token ids past the vocabulary under a clean .idx header", I.out_of_vocabulary),
    "corrupt_newest": ("newest checkpoint corrupt (bytes of a shard zeroed)", O.corrupt_newest),
    "resume_lr": ("resume with 10x the lr", P(O.changed_schedule, name="resume_lr", flags=["--lr", "0.03"],
                                              field="optimizer.lr")),
    "resume_batch": ("resume with another global batch", P(O.changed_schedule, name="resume_batch",
                                                           flags=["--global-batch-size", "8"],
                                                           field="training.global_batch_size")),
    "already_done": ("train_steps <= the checkpoint's step", O.already_done),
    "sigterm_save": ("SIGTERM (job step) with a checkpoint.save", P(O.sigterm, name="sigterm_save", with_save=True)),
    "sigterm_nosave": ("SIGTERM (job step) without a checkpoint.save",
                       P(O.sigterm, name="sigterm_nosave", with_save=False)),
}
HEADER = ("scenario", "layout", "detected", "time to detect", "exit code", "data lost")


def table(rows: list[tuple]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [HEADER]) for i in range(len(HEADER))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(HEADER), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks of the DP-only layout")
    ap.add_argument("--only", default="", help="comma-separated scenario names (see --list)")
    ap.add_argument("--layouts", default="dp,tp2xdp2,tp2xpp2,tp2xcp2,tp2xpp2xdp2",
                    help="comma-separated: dp, tp2xdp2, tp2xpp2, tp2xpp2xdp2 (8 ranks), tp2xcp2")
    ap.add_argument("--timeout", type=positive_float, default=20.0,
                    help="collective timeout, s (ZEROTRON_COLLECTIVE_TIMEOUT)")
    ap.add_argument("--nccl-semantics", action="store_true",
                    help="ZEROTRON_EMULATE_NCCL=1 in every job: no wait() raises, host reads block, "
                         "as under NCCL; the watchdog alone must name a dead or frozen rank")
    ap.add_argument("--out", default=str(ROOT / "runs" / "drill"), help="where the drill's directory is made")
    ap.add_argument("--keep", action="store_true", help="keep the drill's run directories")
    ap.add_argument("--list", action="store_true", help="print the scenarios and exit")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(f"{k:15s} {desc}" for k, (desc, _) in SCENARIOS.items()))
        return 0
    chosen = [s for s in args.only.split(",") if s] or list(SCENARIOS)
    known = layouts(args.nproc)
    wanted = [k for k in args.layouts.split(",") if k]
    for bad in [s for s in chosen if s not in SCENARIOS] + [k for k in wanted if k not in known]:
        ap.error(f"unknown scenario or layout {bad!r}; see --list and --layouts")
    if "dp" in wanted and args.nproc < 2:  # its scenarios kill, freeze or stop rank 1
        ap.error(f"--nproc {args.nproc}: the DP layout needs at least 2 ranks (its faults strike rank 1)")
    check_out_dir(ap, "--out", args.out, "the drill's runs")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="drill_", dir=args.out))
    (root / "tmp").mkdir()
    rows, ok, failed, start = [], True, 0, time.monotonic()
    try:
        for key in wanted:
            d = Drill(root, key, known[key], args.timeout, root / "tmp", args.nccl_semantics)
            for name in chosen:
                desc, fn = SCENARIOS[name]
                print(f"[drill] {d.layout.name} | {name}: {desc} ...", flush=True)
                t = time.monotonic()
                try:
                    row = fn(d)
                except Exception as e:  # noqa: BLE001 - one broken scenario must not hide the others
                    row = Row(f"DRILL ERROR: {type(e).__name__}: {str(e)[:300]}", None, "-", "-", False)
                ok &= row.ok
                failed += not row.ok
                cells = (name, d.layout.name, row.detected + "".join(f" [{n}]" for n in row.notes),
                         fmt_s(row.detect_s), row.exit, row.lost)
                rows.append(cells)
                print(f"[drill] {d.layout.name} | {name}: {'ok' if row.ok else 'FAILED'} in "
                      f"{time.monotonic() - t:.0f} s | {' | '.join(cells[2:])}", flush=True)
    finally:
        print(table(rows))
        print(f"[drill] {len(rows)} scenario runs, {failed} failed; wall {time.monotonic() - start:.0f} s; "
              f"collective timeout {args.timeout:g} s")
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"[drill] run directories kept under {root}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
