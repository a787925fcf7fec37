"""Who a checkpoint directory belongs to, decided without a process group: the run id ignores
where checkpoints go, a restarted attempt of the same job takes its own lock over at once, and
only a step directory ending in ``.tmp`` is a partial checkpoint. (The runs through the entry
point are in ``test_run_ownership.py``.)
"""

from __future__ import annotations

import json

import pytest

from tests.reliability.common import tiny
from zerotron.checkpoint.run_lock import LOCK_NAME


def test_a_copied_checkpoint_directory_is_the_same_run(tmp_path):
    """``checkpoint.save`` says where checkpoints go, not what is trained: a directory copied to
    another file system (or run directory) resumes with ``checkpoint.load=auto``. It used to count
    as a difference, so auto-resume in the copy was refused as "checkpoints of another run"."""
    from zerotron.checkpoint import resume
    from zerotron.config.cli import last_wins, parse_config

    here, there = (parse_config(last_wins(tiny(str(tmp_path)) + ["--save", str(tmp_path / d)]))
                   for d in ("a", "b"))
    assert resume.run_id(here) == resume.run_id(there)
    flat = resume.flatten(there.to_dict())
    assert resume.differences(here.to_dict(), flat, ignore=resume.IGNORED) == []
    other = parse_config(last_wins(tiny(str(tmp_path)) + ["--save", str(tmp_path / "a"),
                                                          "--optimizer.weight_decay", "0.05"]))
    assert resume.run_id(other) != resume.run_id(here)  # what is trained still tells runs apart


def test_an_earlier_attempt_of_this_job_on_another_host_is_taken_over_at_once(tmp_path, monkeypatch):
    """A restarted or requeued job whose rank 0 lands on another node within ``STALE_S`` continues:
    the lock of its own earlier attempt is no refusal. As torchrun's c10d rendezvous sets them,
    the rendezvous address and port differ between attempts; the SLURM job id / torchrun run id
    stay and a restart count grows. Another job's lock, one of the same attempt, and one under
    static rendezvous (run id "none", no SLURM) still stand."""
    from zerotron.checkpoint.run_lock import RunLock, RunLockError

    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                 "MASTER_ADDR", "MASTER_PORT", "ZEROTRON_JOB_ID"):
        monkeypatch.delenv(name, raising=False)

    def holder(lineage: str, attempt: list[int]) -> None:  # rank 0 of that attempt, refreshed just now
        (tmp_path / LOCK_NAME).write_text(json.dumps({
            "host": "node-elsewhere", "pid": 4242, "run_id": "r", "started": 0, "lineage": lineage,
            "attempt": attempt, "job": f"{lineage},MASTER_ADDR=node-elsewhere,MASTER_PORT=34583"}))

    now = {"MASTER_ADDR": "node-b", "MASTER_PORT": "36771", "TORCHELASTIC_RESTART_COUNT": "1"}
    cases = [({"SLURM_JOB_ID": "777", **now}, "slurm:777", [0, 0], True),  # torchrun --max-restarts
             ({"SLURM_JOB_ID": "777", "SLURM_RESTART_COUNT": "1", **now, "TORCHELASTIC_RESTART_COUNT": "0"},
              "slurm:777", [0, 2], True),  # a requeue: torchrun's count starts again
             ({"TORCHELASTIC_RUN_ID": "abc", **now}, "torchelastic:abc", [0, 0], True),
             ({"SLURM_JOB_ID": "777", **now}, "slurm:776", [0, 0], False),  # another job
             ({"SLURM_JOB_ID": "777", **now}, "slurm:777", [0, 1], False),  # not an earlier attempt
             ({"TORCHELASTIC_RUN_ID": "none", **now}, "", [0, 0], False)]  # static rendezvous: unknowable
    for env, lineage, attempt, taken in cases:
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            holder(lineage, attempt)
            if taken:
                lock = RunLock.acquire(tmp_path, "r", refresh_s=None)
                assert "took over the stale lock of host node-elsewhere" in lock.note, (env, lock.note)
                assert "an earlier attempt of this job" in lock.note, (env, lock.note)
                lock.release()
            else:
                with pytest.raises(RunLockError, match="is in use by a run on another host"):
                    RunLock.acquire(tmp_path, "r", refresh_s=None)


def test_only_a_step_directory_ending_in_tmp_is_a_partial_checkpoint(tmp_path):
    from zerotron.checkpoint.files import CheckpointError, check_checkpoint_path

    assert check_checkpoint_path(tmp_path / "exp.tmp") == tmp_path / "exp.tmp"  # a save directory's own name
    with pytest.raises(CheckpointError, match="is a partial checkpoint"):
        check_checkpoint_path(tmp_path / "exp.tmp" / "step_00000006.tmp")
