"""One owner per run directory (issue 46): a second run in a live run's ``logging.run_dir`` is
refused before it touches ``config.yaml`` or ``metrics.jsonl``; a corrupt lock is no traceback.

Through scripts/pretrain_gpt.py's ``main`` on 2 gloo ranks; the live run is a process holding the
lock as a run does (``RunLock.acquire``), and the reference for "untouched" is the bytes of the
files before the second run. That the refusal comes before any process group is held by
``init_distributed`` failing if reached (scripts/drill.py reports the seconds).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

from tests.reliability.common import forbid_process_group, run, tiny
from zerotron.checkpoint.run_lock import LOCK_NAME, RunLock, check_free

HOLD = """import sys, time
from zerotron.checkpoint.run_lock import RunLock
RunLock.acquire(sys.argv[1], "the-first-run", field="logging.run_dir")
print("held", flush=True)
time.sleep(120)
"""


def test_a_second_run_in_a_live_run_directory_is_refused_leaving_its_files(zerotron_cache,
                                                                           tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("the first run's config\n")
    records = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 41))
    (run_dir / "metrics.jsonl").write_text(records)
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        forbid_process_group(monkeypatch)  # refused in preflight, before any process group
        res = run(tiny(zerotron_cache) + ["--run-dir", str(run_dir), "--train-steps", "2"])
    finally:
        proc.kill()
        proc.wait()
    for code, _, err, _ in res:
        assert code == 2, err
        assert f"logging.run_dir={run_dir} is in use by another run" in err, err
        assert f"pid {proc.pid}" in err and "config error" in err, err
    assert (run_dir / "config.yaml").read_text() == "the first run's config\n"
    assert (run_dir / "metrics.jsonl").read_text() == records
    assert not (run_dir / "metrics.superseded.jsonl").exists()


def test_a_corrupt_lock_is_taken_over_not_a_traceback(tmp_path):
    host = socket.gethostname()
    for content in ("{not json", json.dumps({"host": host, "pid": "abc", "started": "x"}),
                    json.dumps({"host": host, "pid": -1, "started": 0}), json.dumps([1, 2])):
        (tmp_path / LOCK_NAME).write_text(content)
        old = time.time() - 60
        os.utime(tmp_path / LOCK_NAME, (old, old))
        check_free(tmp_path, "logging.run_dir")  # not held by a live run: no refusal, no exception
        lock = RunLock.acquire(tmp_path, "mine", refresh_s=None, field="logging.run_dir")
        assert lock.note and "took over" in lock.note, content
        lock.release()
        assert not (tmp_path / LOCK_NAME).exists()


def full_run_dir(run_dir, cache) -> str:
    """Two steps with rank 0's ``metrics.jsonl`` on a full disk; what each rank stops with."""
    import torch.distributed as dist

    from tests.training.test_trainer import make_config
    from zerotron.parallel.runtime import init_distributed
    from zerotron.training.build_run import build_run
    from zerotron.training.trainer import Trainer, TrainingStopped

    cfg = make_config(run_dir, cache, "--log-interval", "1", "--train-steps", "3")
    trainer = Trainer(build_run(cfg.validate(dist.get_world_size()), init_distributed()))

    class FullDisk:
        def write(self, text):
            raise OSError(28, os.strerror(28), str(run_dir / "metrics.jsonl"))

        def close(self):
            raise OSError(28, os.strerror(28))

    if trainer.grid.rank == 0:
        trainer.logger._file = FullDisk()
    try:
        trainer.train()
    except TrainingStopped as e:
        return f"step {trainer.step}: {e}"
    return "trained on"


def test_a_full_run_directory_is_named_by_every_rank_not_blamed_on_a_dead_one(zerotron_cache,
                                                                              tmp_path):
    from tests.harness import spawn

    got = spawn(full_run_dir, 2, tmp_path / "run", zerotron_cache, timeout=120)
    assert got[0].startswith("step 1: cannot write") and "No space left on device" in got[0], got
    assert "logging.run_dir" in got[0]
    assert got[1] == f"step 1: rank 0 cannot write logging.run_dir={tmp_path / 'run'}", got


def test_a_run_whose_checkpoints_go_into_its_run_directory_itself_holds_one_lock(zerotron_cache,
                                                                                tmp_path):
    res = run(tiny(zerotron_cache) + ["--run-dir", str(tmp_path), "--save", str(tmp_path),
                                      "--train-steps", "1"], world=1)
    assert res[0][0] == 0, res[0][2]
    assert (tmp_path / "step_00000001" / "metadata.json").is_file()
    assert not (tmp_path / LOCK_NAME).exists()


def read_only_mid_run(run_dir, cache) -> tuple[int, str]:
    """scripts/pretrain_gpt.py's ``main`` whose run directory goes read-only on rank 0 after
    step 2, as a remount would: ``metrics.jsonl``'s open file and the lock's removal meet EROFS."""
    import errno

    from tests.reliability.common import _main
    from zerotron.training import trainer
    from zerotron.checkpoint import run_lock

    def erofs(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    class ReadOnly:
        def write(self, *text):
            erofs(run_dir / "metrics.jsonl")

        close = flush = write

    real_step, real_unlink = trainer.Trainer.train_step, run_lock.Path.unlink

    def step(self, *args, **kwargs):
        if self.step == 2 and self.grid.rank == 0:
            self.logger._file = ReadOnly()
            run_lock.Path.unlink = lambda p, *a, **k: erofs(p) if p.parent == run_dir else \
                real_unlink(p, *a, **k)
        return real_step(self, *args, **kwargs)

    trainer.Trainer.train_step = step
    code, _, err, _ = _main(tiny(cache) + ["--train-steps", "4", "--run-dir", str(run_dir)],
                            {"ZEROTRON_FAULT": ""})
    return code, err


def test_a_read_only_remount_mid_run_is_one_line_per_rank_and_exit_2(zerotron_cache, tmp_path):
    """It was a triple traceback on rank 0: the lock's removal raised over the stop itself."""
    from tests.harness import spawn

    run_dir = tmp_path / "run"
    (code0, err0), (code1, err1) = spawn(read_only_mid_run, 2, run_dir, zerotron_cache,
                                         timeout=120)
    assert (code0, code1) == (2, 2), (err0, err1)
    assert "Traceback" not in err0 + err1, err0
    assert f"TrainingStopped: cannot write {run_dir / 'metrics.jsonl'} (Read-only file system); " \
           f"the file system of logging.run_dir={run_dir} is read-only: remount it writable" in err0
    assert f"could not remove the lock {run_dir / LOCK_NAME} (Read-only file system)" in err0
    assert f"[rank 1] TrainingStopped: rank 0 cannot write logging.run_dir={run_dir}" in err1
