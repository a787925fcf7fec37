"""Reliability drills through the real entry point (scripts/pretrain_gpt.py ``main``) on 2 gloo ranks.

Dead and stuck ranks are named by the survivors, which exit 3 within the collective timeout; a
crash in the middle of a checkpoint write loses nothing (the resumed run ends exactly where an
uninterrupted one does); an fp16 overflow storm and a NaN loss stop the run with the step, the
data position and the fix. Faults are armed with ``ZEROTRON_FAULT`` (zerotron/parallel/faults.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.reliability.common import run, tiny


@pytest.mark.parametrize("layout", [[], ["--pp", "2"]], ids=["dp2", "pp2"])
def test_dead_rank_is_named_and_the_survivor_exits_3(zerotron_cache, tmp_path, layout):
    """DP: the survivor waits in a gradient reduction; PP: in the pipeline's receive from the dead stage."""
    argv = tiny(zerotron_cache) + ["--train-steps", "6", "--run-dir", str(tmp_path)] + layout
    res = run(argv, fault="kill@step=3@rank=1", may_die=(1,), collective_timeout=20)
    assert res[1] is None
    code, _, err, seconds = res[0]
    assert code == 3, err
    assert "CollectiveError" in err and "rank 1" in err and "dead" in err, err
    assert seconds < 20


def test_stuck_rank_is_named_within_the_timeout(zerotron_cache, tmp_path):
    argv = tiny(zerotron_cache) + ["--train-steps", "6", "--run-dir", str(tmp_path)]
    res = run(argv, fault="stall@step=3@rank=1", env={"ZEROTRON_FAULT_STALL_S": "30"}, may_die=(1,),
              collective_timeout=5)
    code, _, err, seconds = res[0]
    assert code == 3, err
    assert "rank 1 is alive but stuck behind" in err, err
    assert seconds < 30  # named before the stuck rank woke up (start-up under load included)


def _losses(run_dir: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


@pytest.mark.parametrize("fault, layout", [
    ("kill_after_shard@step=4@rank=1", []), ("kill_before_commit@step=4@rank=0", []),
    ("kill_after_shard@step=4@rank=3", ["--tp", "2", "--pp", "2"]),  # the last stage's second TP rank
], ids=["after_shard-dp2", "before_commit-dp2", "after_shard-tp2xpp2"])
def test_crash_mid_checkpoint_loses_nothing(zerotron_cache, tmp_path, fault, layout):
    save = tmp_path / "ck"
    argv = tiny(zerotron_cache) + ["--train-steps", "6", "--save", str(save), "--save-interval", "2"] + layout
    dead, world = int(fault[-1]), 4 if layout else 2
    res = run(argv + ["--run-dir", str(tmp_path / "a")], fault=fault, world=world, may_die=(dead,))
    for rank, survivor in enumerate(res):
        if rank != dead:
            assert survivor[0] == 3, survivor[2]
            assert set(re.findall(r"rank (\d+) is dead or frozen", survivor[2])) == {str(dead)}, survivor[2]
    assert (save / "step_00000002" / "metadata.json").is_file()
    assert (save / "step_00000004.tmp").is_dir() and not (save / "step_00000004").exists()

    res = run(argv + ["--run-dir", str(tmp_path / "b"), "--load", str(save)], world=world)
    assert [r[0] for r in res] == [0] * world, res[0][2]
    out = res[0][1]
    assert "skipping partial checkpoint(s) step_00000004.tmp" in out, out
    assert "loaded" in out and "(step 2," in out, out
    assert (save / "step_00000006" / "metadata.json").is_file() and not (save / "step_00000004.tmp").exists()

    clean = run(tiny(zerotron_cache) + ["--train-steps", "6", "--run-dir", str(tmp_path / "c")] + layout, world=world)
    assert [r[0] for r in clean] == [0] * world
    resumed, whole = _losses(tmp_path / "b"), _losses(tmp_path / "c")
    assert sorted(resumed) == [3, 4, 5, 6] and resumed == {s: whole[s] for s in resumed}, (resumed, whole)  # bitwise


@pytest.mark.parametrize("scaling,where,stop", [
    (["--optimizer.initial_loss_scale", "4294967296", "--optimizer.min_loss_scale", "4294967296",
      "--optimizer.hysteresis", "1"], "minimum loss scale 4.29497e+09 (optimizer.min_loss_scale", 8),
    # step 1 runs at 2^33 and halves the scale to the floor: it is not one of the 8 at the floor
    (["--optimizer.initial_loss_scale", "8589934592", "--optimizer.min_loss_scale", "4294967296",
      "--optimizer.hysteresis", "1"], "minimum loss scale 4.29497e+09 (optimizer.min_loss_scale", 9),
    (["--optimizer.loss_scale", "4294967296"], "static loss scale 4.29497e+09 (optimizer.loss_scale", 8),
], ids=["dynamic", "dynamic_halved_to_floor", "static"])
def test_fp16_overflow_storm_stops_with_step_scale_and_fix(zerotron_cache, tmp_path, scaling, where, stop):
    argv = tiny(zerotron_cache) + ["--train-steps", "20", "--run-dir", str(tmp_path), "--precision", "fp16",
                                   "--log-interval", "1"] + scaling
    res = run(argv)
    for code, _, err, _ in res:
        assert code == 2, err
        assert f"TrainingStopped: gradient overflow storm: 8 consecutive steps up to step {stop}" in err, err
        assert where in err, err
        assert "training.precision=bf16" in err  # the fix
    # every step was skipped, so the schedule never left its first rate (DeepSpeed, Megatron)
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, stop)) and all(r["skipped_steps"] == r["step"] for r in recs)
    assert f"step {stop - 1}/20 |" in res[0][1] and f"| skipped {stop - 1}" in res[0][1], res[0][1]  # console too
    assert {r["lr"] for r in recs} == {recs[0]["lr"]} and recs[0]["lr"] > 0, [r["lr"] for r in recs]


@pytest.mark.parametrize("precision, layout, fault", [
    ("bf16", [], "nan@step=3"), ("fp32", [], "nan@step=3"),
    ("fp32", ["--pp", "2"], "nan@step=3@rank=0"),  # the first stage's weight: the last stage's loss, both stop
], ids=["bf16-dp2", "fp32-dp2", "fp32-pp2-first-stage"])
def test_nan_loss_stops_with_step_and_data_position(zerotron_cache, tmp_path, precision, layout, fault):
    argv = tiny(zerotron_cache) + ["--train-steps", "6", "--run-dir", str(tmp_path), "--precision", precision] + layout
    res = run(argv, fault=fault)
    for code, _, err, _ in res:
        assert code == 2, err
        assert "TrainingStopped: loss is nan at step 3 (consumed samples 8)" in err, err


def test_fp16_skipped_steps_count_across_a_resume(zerotron_cache, tmp_path):
    """``skipped_steps`` is the run's total (steps minus optimizer updates, both in the checkpoint):
    a run resumed at step 3 logs, step for step, what an uninterrupted run does."""
    fp16 = tiny(zerotron_cache) + ["--precision", "fp16", "--log-interval", "1", "--optimizer.hysteresis", "1",
                                   "--optimizer.initial_loss_scale", str(2.0 ** 20)]

    def skipped(run_dir: Path) -> dict[int, int]:
        recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["skipped_steps"] for r in recs if "skipped_steps" in r}

    whole = run(fp16 + ["--train-steps", "6", "--run-dir", str(tmp_path / "whole")])
    assert [r[0] for r in whole] == [0, 0], whole[0][2]
    save = tmp_path / "ck"
    first = run(fp16 + ["--train-steps", "3", "--run-dir", str(tmp_path / "a"), "--save", str(save)])
    assert [r[0] for r in first] == [0, 0], first[0][2]
    resumed = run(fp16 + ["--train-steps", "6", "--run-dir", str(tmp_path / "b"), "--save", str(save),
                          "--load", str(save / "step_00000003")])
    assert [r[0] for r in resumed] == [0, 0], resumed[0][2]
    want = skipped(tmp_path / "whole")
    assert 0 < want[3] and want[6] < 6, want  # skips before the resume, updates after it
    assert skipped(tmp_path / "b") == {s: want[s] for s in (4, 5, 6)}, (skipped(tmp_path / "b"), want)
