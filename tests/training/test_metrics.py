"""A resumed run's ``metrics.jsonl`` holds one record per step: what an earlier attempt logged past
the checkpoint it resumes is moved aside to ``metrics.superseded.jsonl`` (nothing is deleted), and
the move is said."""

from __future__ import annotations

import json

from zerotron.training.metrics import SUPERSEDED, MetricsLogger


def _write(path, steps, torn=False):
    lines = [json.dumps({"step": s, "loss": float(s)}) for s in steps]
    path.write_text("\n".join(lines) + "\n" + ('{"step": 7, "lo' if torn else ""))


def test_records_past_the_resumed_step_are_moved_aside_and_said(tmp_path, capsys):
    _write(tmp_path / "metrics.jsonl", [1, 2, 3, 4, 5, 6], torn=True)  # killed at step 7, mid-write
    logger = MetricsLogger(str(tmp_path), {}, enabled=True, wandb_mode="disabled", total_steps=8, start_step=4)
    logger.log({"step": 5, "loss": 50.0, "lr": 0.1})
    logger.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]
    moved = (tmp_path / SUPERSEDED).read_text().splitlines()
    assert [json.loads(line)["step"] for line in moved[:2]] == [5, 6] and moved[2] == '{"step": 7, "lo'
    assert f"3 record(s) of {tmp_path / 'metrics.jsonl'} past step 4" in capsys.readouterr().out


def test_a_run_that_continues_where_the_file_ends_moves_nothing(tmp_path, capsys):
    _write(tmp_path / "metrics.jsonl", [1, 2, 3, 4])
    MetricsLogger(str(tmp_path), {}, enabled=True, wandb_mode="disabled", start_step=4).close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4
    assert not (tmp_path / SUPERSEDED).exists() and "[metrics]" not in capsys.readouterr().out


def test_a_second_live_run_in_the_directory_rewrites_nothing_and_says_so(tmp_path, capsys):
    first = MetricsLogger(str(tmp_path), {}, enabled=True, wandb_mode="disabled", start_step=0)
    first.log({"step": 1, "loss": 1.0, "lr": 0.1})
    second = MetricsLogger(str(tmp_path), {}, enabled=True, wandb_mode="disabled", start_step=0)
    first.log({"step": 2, "loss": 2.0, "lr": 0.1})  # still reaches the file: it was not replaced
    second.close()
    first.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2] and not (tmp_path / SUPERSEDED).exists()
    assert "another live run writes" in capsys.readouterr().out


def _windows_around_slow_breaks(run_dir, cache, pause_s):
    """metrics.jsonl of a TP 2 run whose start-up and every evaluation take ``pause_s`` longer, on
    the clock the throughput windows read (``metrics.time.perf_counter``): the pauses are added to
    that clock rather than slept, so no step of a loaded machine comes near them."""
    import time
    import types

    import torch.distributed as dist

    from tests.training.test_trainer import make_config
    from zerotron.parallel.runtime import init_distributed
    from zerotron.training import metrics
    from zerotron.training.build_run import build_run
    from zerotron.training.trainer import Trainer

    skipped = [0.0]  # seconds the pauses have added to the metrics' clock
    metrics.time = types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + skipped[0])

    def pause():
        skipped[0] += pause_s

    cfg = make_config(run_dir, cache, "--tp", "2", "--train-steps", "3", "--log-interval", "1",
                      "--eval-interval", "1", "--logging.eval_steps", "1").validate(dist.get_world_size())
    trainer = Trainer(build_run(cfg, init_distributed()))
    evaluate = trainer.evaluate
    trainer.evaluate = lambda: (pause(), evaluate())[1]
    pause()
    trainer.train()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_step_time_and_comm_bytes_leave_out_start_up_and_evaluation(zerotron_cache, tmp_path):
    """A window's step time and traffic are its training steps' own (Megatron stops its interval
    timer for evaluation and checkpoints): not the start-up's, nor the evaluation's TP all-reduces."""
    from tests.harness import spawn

    pause_s = 1000.0  # far beyond any step, however loaded the machine: no timing is judged here
    records = spawn(_windows_around_slow_breaks, 2, tmp_path, zerotron_cache, pause_s, timeout=240)[0]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["step_time_s"] < pause_s / 2 for r in steps), [r["step_time_s"] for r in steps]
    assert steps[0]["comm_bytes"]["tp"] == steps[1]["comm_bytes"]["tp"] == steps[2]["comm_bytes"]["tp"]
    assert steps[1]["comm_bytes"] == steps[2]["comm_bytes"]  # step 1's window ends before its stop agreement
