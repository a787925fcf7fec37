"""``checkpoint.async_save``: the background writer writes the very shard a synchronous save
writes, a rank killed during a background write loses only the checkpoint in flight, and the
resumed run is bit-identical to an uninterrupted one (scripts/pretrain_gpt.py ``main``, 2 ranks).

The reference is the synchronous save, whose own guarantees tests/reliability/test_faults.py holds.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from tests.reliability.common import run, start, tiny


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _shas(checkpoint: Path) -> dict[str, str]:
    files = json.loads((checkpoint / "metadata.json").read_text())["files"]
    return {name: entry["sha256"] for name, entry in files.items()}


def _losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    losses = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # the line rank 0 is writing: read at the next poll
            continue
        if "loss" in rec:
            losses[rec["step"]] = rec["loss"]
    return losses


def test_killed_in_background_write_resumes_bit_identical(zerotron_cache, tmp_path):
    argv = tiny(zerotron_cache) + ["--train-steps", "6", "--save-interval", "2"]
    sync, ck = tmp_path / "sync", tmp_path / "ck"
    keep = ["--checkpoint.keep_last", "3"]
    res = run(argv + ["--run-dir", str(sync), "--save", str(tmp_path / "ck_sync")] + keep)
    assert [r[0] for r in res] == [0, 0], res[0][2]

    # rank 1 dies on its writer thread during the step-4 save: its shard is on disk, uncommitted
    async_argv = argv + ["--save", str(ck), "--checkpoint.async_save", "true"]
    res = run(async_argv + ["--run-dir", str(tmp_path / "a")], fault="kill_in_writer@step=4@rank=1",
              may_die=(1,))
    assert res[1] is None
    code, out, err, _ = res[0]
    assert code == 3 and set(re.findall(r"rank (\d+) is dead or frozen", err)) == {"1"}, err
    assert "step_00000004 was written in the background but not committed" in out, out
    assert (ck / "step_00000004.tmp").is_dir() and not (ck / "step_00000004").exists()
    # the previous checkpoint, written in the background too: committed, bitwise the synchronous one
    assert _shas(ck / "step_00000002") == _shas(tmp_path / "ck_sync" / "step_00000002")

    # the same command (load=auto); its step-4 writers are held until step 5 has been trained,
    # so the shard written must be the step-4 copy, not the state the loop has moved on to
    release = tmp_path / "release"
    hold = {"ZEROTRON_FAULT_PAUSE_FILE": str(release), "ZEROTRON_FAULT_STALL_S": "90"}
    with start(async_argv + ["--run-dir", str(tmp_path / "b")], fault="hold_writer@step=4",
               env=hold) as ranks:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and 5 not in _losses(tmp_path / "b"):
            time.sleep(0.1)
        release.touch()
        res = ranks.wait(60)
    assert [r[0] for r in res] == [0, 0], res[0][2]
    assert _shas(ck / "step_00000004") == _shas(tmp_path / "ck_sync" / "step_00000004")
    out = res[0][1]
    assert "skipping partial checkpoint(s) step_00000004.tmp" in out, out
    assert "(step 2," in out, out
    assert _shas(ck / "step_00000006") == _shas(tmp_path / "ck_sync" / "step_00000006")

    whole, resumed = _losses(sync), _losses(tmp_path / "b")
    assert sorted(resumed) == [3, 4, 5, 6] and resumed == {s: whole[s] for s in resumed}  # bitwise

    saves = [r for r in _records(tmp_path / "b") if "checkpoint_total_s" in r]
    assert [(r["checkpoint_step"], r["checkpoint_async"]) for r in saves] == [(4, True), (6, True)]
    assert all(0 < r["checkpoint_blocking_s"] <= r["checkpoint_total_s"] for r in saves), saves
    assert saves[0]["step"] >= 4  # committed at a later step boundary, or before the next save
    sync_saves = [r for r in _records(sync) if "checkpoint_total_s" in r]
    assert [(r["step"], r["checkpoint_step"], r["checkpoint_async"]) for r in sync_saves] == [
        (2, 2, False), (4, 4, False), (6, 6, False)]
    assert all(r["checkpoint_blocking_s"] == r["checkpoint_total_s"] for r in sync_saves)


def test_a_stopped_run_commits_the_save_in_flight(zerotron_cache, tmp_path):
    """A NaN loss at step 3 raises ``TrainingStopped`` inside step 3, before any step boundary
    could commit the step-2 background save: the stop itself must wait for it and commit it."""
    ck = tmp_path / "ck"
    argv = tiny(zerotron_cache) + ["--train-steps", "6", "--save-interval", "2", "--save", str(ck),
                                   "--checkpoint.async_save", "true", "--run-dir", str(tmp_path)]
    res = run(argv, fault="nan@step=3")
    for code, _, err, _ in res:
        assert code == 2 and "TrainingStopped: loss is nan at step 3" in err, err
    assert f"[checkpoint] saved {ck / 'step_00000002'}" in res[0][1], res[0][1]
    assert (ck / "step_00000002" / "metadata.json").is_file() and not list(ck.glob("*.tmp"))


def _sigterm_at_step_3(run_dir, cache, ck):
    """2 ranks, async saves every 2 steps, the step-2 writers held 2 s; rank 0 alone gets SIGTERM
    after step 3 (as test_trainer's synchronous case)."""
    import os
    import signal

    import torch.distributed as dist

    from tests.training.test_trainer import make_config
    from zerotron.parallel.runtime import init_distributed
    from zerotron.training.build_run import build_run
    from zerotron.training.trainer import Trainer

    os.environ.update(ZEROTRON_FAULT="hold_writer@step=2", ZEROTRON_FAULT_STALL_S="2")
    cfg = make_config(run_dir, cache, "--save", ck, "--save-interval", "2",
                      "--checkpoint.async_save", "true").validate(dist.get_world_size())
    trainer = Trainer(build_run(cfg, init_distributed()))
    step = trainer.train_step

    def preempted_step():
        out = step()
        if trainer.step == 3 and dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    trainer.train_step = preempted_step
    trainer.train()
    return trainer.step


def test_sigterm_waits_for_the_background_saves(zerotron_cache, tmp_path):
    from tests.harness import spawn

    ck = tmp_path / "ck"
    out = spawn(_sigterm_at_step_3, 2, tmp_path / "run", zerotron_cache, ck, timeout=120)
    assert out == [3, 3]
    steps = ["step_00000002", "step_00000003"]
    assert sorted(p.name for p in ck.iterdir()) == steps
    assert all((ck / s / "metadata.json").is_file() for s in steps)
