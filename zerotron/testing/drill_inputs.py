"""Drill scenarios of bad numbers, bad files and bad disks: an fp16 overflow storm, a NaN loss, a
full disk during a save (one rank's, injected; and a real one, a small tmpfs), broken token files,
an oversized tokenizer, a read-only checkpoint directory and bad config values.

Input errors must be refused on every rank before ``init_process_group`` (exit 2, naming the
field); run-time errors must stop the run naming the step (or the rank and the cause) with the
last checkpoint intact.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

from zerotron.testing.drill_job import ROOT, Job, Row, complete_steps, intact
from zerotron.testing.drill_run import BASE_STEPS, JOB_S, Drill

PRE_INIT = r"^\[rank (\d+)\] config error: "  # printed only by pretrain_gpt's pre-init branch
POST_INIT = r"^\[zerotron\] world |^\[checkpoint\] "  # lines only a started run prints


def corpus(d: Drill) -> Path:
    """Copies of the built-in corpus to break: truncated ``.bin``, ``.idx`` sizes off by 3, a corpus
    shorter than one sample; made once per drill under its directory."""
    from zerotron.data import IndexedTokenWriter, build_default_corpus

    dst = d.root.parent / "corpus"
    if (dst / "done").exists():
        return dst
    train, tok, _ = build_default_corpus(str(ROOT / ".cache" / "zerotron"), vocab_size=1024)
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(tok, dst / "tokenizer.model")
    for kind in ("train", "truncated", "badidx", "oov"):
        for ext in (".bin", ".idx"):
            shutil.copy(train + ext, dst / f"{kind}{ext}")
    with open(dst / "truncated.bin", "r+b") as f:
        f.truncate(os.path.getsize(dst / "truncated.bin") - 100)
    head = np.fromfile(dst / "badidx.idx", np.uint8, 48)
    n_docs = int(head[32:40].view(np.uint64)[0])
    idx = np.memmap(dst / "badidx.idx", np.uint8, "r+")
    idx[48 + 8 * (n_docs + 1):48 + 8 * (n_docs + 1) + 4 * n_docs].view(np.int32)[n_docs // 2] += 3
    idx.flush()
    oov = np.memmap(dst / "oov.bin", np.uint16, "r+")  # the header still says max id < 1024
    oov[::7] = 5000
    oov.flush()
    del oov
    with IndexedTokenWriter(str(dst / "short"), 1024) as w:
        w.add_document(list(range(1, 11)))  # 10 tokens; a sample of seq 64 needs 65
    (dst / "empty.yaml").write_text("# an empty run config\n")
    (dst / "done").write_text("")
    return dst


def refused(d: Drill, name: str, extra: list[str], field: str, save: str | None = None) -> tuple[Job, int, bool, str]:
    """Launch a bad run. True when every rank that got as far as its checks printed a pre-init
    config error naming ``field`` and exited 2, and nothing of a started run appeared; the others
    were stopped by torchrun (-15) after the first refusal. Also says which ranks refused."""
    job = d.job(d.argv(name, 4, save, *extra))
    code = job.wait(JOB_S)
    ranks = {int(re.match(PRE_INIT, line).group(1)) for _, line in job.all(PRE_INIT) if re.search(field, line)}
    exits = job.worker_exits()
    stopped = sorted(r for r in range(d.layout.nproc) if r not in ranks and exits.get(r) == -15)
    ok = (bool(ranks) and len(ranks) + len(stopped) == d.layout.nproc and not job.first(POST_INIT)
          and job.exited(2))
    who = ("every rank" if len(ranks) == d.layout.nproc else
           f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}"
           + (f"; rank{'s' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))} stopped by torchrun first"
              if stopped else ""))
    return job, code, ok, who


def data_fault(d: Drill, name: str, prefix: str, field: str, extra: tuple[str, ...] = ()) -> Row:
    c = corpus(d)
    job, code, ok, who = refused(d, name, ["--data.tokenizer", str(c / "tokenizer.model"),
                                           "--data.data_path", str(c / prefix), *extra], field)
    hit = job.first(PRE_INIT)
    text = d.short(_reason(hit[1].split("config error: ", 1)[1]) if hit else "NOT REFUSED", 120) + \
        (f" ({who}, before init_process_group)" if ok else f" (NOT REFUSED AS EXPECTED: {who})")
    return Row(text, (job.end - job.start), job.exit_text(code), "none (refused at start-up)", ok)


def out_of_vocabulary(d: Drill, name: str = "oov") -> Row:
    """Every 7th id of a corpus copy set to 5000 under an ``.idx`` header that still says < 1024:
    the first step reads one, and the run stops (exit 2) naming the token file and the document
    before the model sees it (it trained on in silence at TP 2 and crashed at TP 1)."""
    c = corpus(d)
    job = d.job(d.argv(name, 4, None, "--data.tokenizer", str(c / "tokenizer.model"),
                       "--data.data_path", str(c / "oov")))
    code = job.wait(JOB_S)
    hit = job.first(r"token id 5000 in .*oov\.bin, document \d+")
    ok = hit is not None and job.exited(2) and not job.first(r"\| loss ")
    named = hit[1].split("token id ", 1)[1].split(", read for")[0] if hit else ""
    text = (d.short("stopped naming token id " + named, 120)
            if hit else "NOT DETECTED: the run trained on, or died without naming the file")
    took = (hit[0] - job.start) if hit else None
    return Row(text, took, job.exit_text(code), "none (stopped before any step trained on it)", ok)


def _reason(message: str) -> str:
    """``field=<path>: <path>.idx is corrupt: ...`` read as ``field=<path>: .idx is corrupt: ...``."""
    head, _, rest = message.partition(": ")
    value = head.partition("=")[2]
    return f"{head}: {rest.replace(value, '', 1).lstrip('. ')}" if value and rest.startswith(value) else message


BAD_CONFIG = {  # name: (flags, the field the error must name); {c}: the corpus copies
    "lr=inf": (["--lr", "inf"], r"optimizer\.lr"),
    "eps<0": (["--optimizer.eps", "-1"], r"optimizer\.eps"),
    "int 2.5e0": (["--train-steps", "2.5e0"], r"training\.train_steps"),
    "empty YAML": (["--config", "{c}/empty.yaml"], r"--config .*empty"),
    "weight<0": (["--data.tokenizer", "{c}/tokenizer.model", "--data.data_path", "{c}/train,{c}/train",
                  "--data.data_weights", "1,-1"], r"data\.data_weights"),
    "corpus < seq+1": (["--data.tokenizer", "{c}/tokenizer.model", "--data.data_path", "{c}/short"],
                       r"data\.data_path=.*fewer than model\.seq_length"),
    "positions": (["--model.max_position_embeddings", "32"], r"model\.max_position_embeddings"),
    "global batch": (["--global-batch-size", "5"], r"training\.global_batch_size"),
}


def bad_config(d: Drill, name: str = "bad_config") -> Row:
    c = corpus(d)
    good, slow, codes, bad = 0, 0.0, set(), []
    for i, (case, (flags, field)) in enumerate(BAD_CONFIG.items()):
        job, code, ok, _ = refused(d, f"{name}/{i}", [f.format(c=c) for f in flags], field)
        good += ok
        slow = max(slow, job.end - job.start)
        codes.add(job.exit_text(code))
        if not ok:
            bad.append(case)
    text = (f"{good}/{len(BAD_CONFIG)} refused before init_process_group, naming the field "
            f"({', '.join(BAD_CONFIG)})") + (f"; NOT: {', '.join(bad)}" if bad else "")
    return Row(text, slow, " / ".join(sorted(codes)), "none (refused at start-up)", not bad)


def _mount(path: Path, options: str) -> bool:
    """A tmpfs at ``path`` (needs root); False where it cannot be made."""
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", str(path)], capture_output=True)


def read_only(d: Drill, name: str = "read_only") -> Row:
    """``checkpoint.save`` on a read-only file system (a read-only tmpfs; ``chmod 555`` when not root)."""
    save = d.root / name / "ck"
    mounted = _mount(save, "ro,size=64k")
    how = "read-only tmpfs" if mounted else "chmod 555"
    if not mounted:
        save.chmod(0o555)
    try:
        job, code, ok, who = refused(d, name, [], r"checkpoint\.save=.*cannot write", str(save))
    finally:
        if mounted:
            _umount(save)
        else:
            save.chmod(0o755)
    hit = job.first(PRE_INIT)
    text = (f"{how}: " + d.short(hit[1].split("config error: ", 1)[1] if hit else "NOT REFUSED", 100)
            + (f" ({who}, before init_process_group)" if ok else f" (NOT REFUSED AS EXPECTED: {who})"))
    return Row(text, job.end - job.start, job.exit_text(code), "none (refused at start-up)", ok)


def _stopped(d: Drill, name: str, env: dict, pattern: str, resume: bool, since: str, steps: int = BASE_STEPS,
             extra: tuple[str, ...] = (), save: Path | None = None) -> Row:
    """A run that must stop by itself: every rank prints ``pattern``; the checkpoints left intact.
    Timed from the ``[fault]`` line, else from the first line matching ``since`` (the fault's step)."""
    save = save or d.root / name / "ck"
    job = d.job(d.argv(name, steps, save, *extra), env)
    code = job.wait(JOB_S)
    start = job.first(r"\[fault\]") or job.first(since)
    ranks = {re.match(r"^\[rank (\d+)\]", line).group(1) for _, line in job.all(r"^\[rank \d+\] .*" + pattern)}
    hit = job.first(pattern)
    detect = (hit[0] - start[0]) if hit and start else None
    every = len(ranks) == d.layout.nproc
    said = hit[1].split("] ", 1)[-1].split(" (this rank:")[0].split("; rerun")[0] if hit else f"/{pattern}/ NOT SEEN"
    text = d.short(said, 120) + (" (every rank)" if every else f" (ranks {sorted(ranks)} only)")
    steps_left, problems = intact(save)
    if resume:
        lost, ok = d.resume(name, save, steps, steps_left[-1] if steps_left else None, extra)
    else:
        ok = not problems
        lost = (f"none (stopped; step_{steps_left[-1]:08d} intact)" if steps_left and ok else
                f"{'; '.join(problems) or 'no checkpoint'}")
    return Row(text, detect, job.exit_text(code), lost, bool(hit) and every and ok and not problems)


def overflow(d: Drill) -> Row:
    """Every step overflows at a loss scale pinned to 2^32: stopped after 8 (timed from step 1)."""
    return _stopped(d, "overflow", {}, r"gradient overflow storm", False, r"^step\s+1\b", extra=(
        "--precision", "fp16", "--optimizer.initial_loss_scale", "4294967296",
        "--optimizer.min_loss_scale", "4294967296", "--optimizer.hysteresis", "1"))


def nan(d: Drill) -> Row:
    """A weight set to NaN at the start of step 6 (timed from the end of step 5)."""
    return _stopped(d, "nan", {"ZEROTRON_FAULT": "nan@step=6"}, r"loss is nan at step 6", True, r"^step\s+5\b",
                    extra=("--precision", "bf16"))


def enospc_rank(d: Drill) -> Row:
    k = d.layout.nproc - 1
    return _stopped(d, "enospc", {"ZEROTRON_FAULT": f"enospc@step=8@rank={k}"}, rf"disk full on rank {k}\b", True,
                    r"^step\s+8\b")


def disk_full(d: Drill, name: str = "disk_full") -> Row:
    """A real full disk: ``checkpoint.save`` on a tmpfs with room for one checkpoint and not two
    (passing the start-up room check), so the step-8 save runs out of space on whichever ranks
    write last. After the failure the tmpfs is enlarged ("free space") and the run resumed."""
    from zerotron.config.cli import parse_config
    from zerotron.training.setup_run import checkpoint_bytes, validate_model

    d.base()
    actual = sum(f.stat().st_size for f in (d.base() / "step_00000008").iterdir())
    cfg = parse_config(d.argv(name, BASE_STEPS))
    cfg.validate(d.layout.nproc)
    need = checkpoint_bytes(cfg, validate_model(cfg))[0]
    size = (need + 2 * actual) // 2
    if size <= need * 1.02:
        return Row(f"n/a: the start-up estimate {need} B does not leave room below two checkpoints",
                   None, "-", "-", True)
    save = d.root / name / "ck"
    if not _mount(save, f"size={size // 1024}k"):
        return Row("n/a: no tmpfs (needs root); the injected enospc scenario covers one rank", None, "-", "-", True)
    try:
        row = _stopped(d, name, {}, r"CheckpointWriteError: .*disk full on rank", False, r"^step\s+8\b", save=save)
        row.detected = f"tmpfs of {size / 2**20:.1f} MiB, checkpoint {actual / 2**20:.1f} MiB: " + row.detected
        subprocess.run(["mount", "-o", "remount,size=64m", str(save)], capture_output=True)
        steps_left = complete_steps(save)
        row.lost, resumed = d.resume(name, save, BASE_STEPS, steps_left[-1] if steps_left else None)
        row.lost += " after freeing space"
        row.ok = row.ok and resumed
        return row
    finally:
        _umount(save)
