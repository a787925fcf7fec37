"""The console a person reads (``training/run_log.py``) and the trackers (``training/tracking.py``).

Two short runs on 2 gloo ranks in one spawn: DP 2 with checkpoints, wandb offline and
TensorBoard; PP 2 in bf16 at stage 1 without contiguous gradients, with no checkpoint directory. The banner's figures are checked against what the
ranks hold (parameters) and what the memory model says; log lines against ``step N/M``, elapsed
and ETA; the summary against the run (a checkpoint is named only when one was written); wandb's
run config against the resolved model, and wandb's own files against the run directory (HOME is
a fresh folder, so anything written to ``~/.cache/wandb`` would show).
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import re
import tempfile
from pathlib import Path

import pytest

from tests.harness import spawn
from zerotron.training.run_log import count, duration

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4


def _run(cache: str, tmp: str, name: str, *flags) -> dict:
    import torch.distributed as dist

    from zerotron.estimate import memory_model
    from zerotron.parallel.runtime import init_distributed
    from zerotron.config.cli import parse_config
    from zerotron.training.build_run import build_run
    from zerotron.training.trainer import Trainer

    base = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--tp", "1", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-steps", str(STEPS),
            "--log-interval", "2", "--eval-interval", "0", "--run-dir", f"{tmp}/{name}", "--data.cache_dir", cache,
            "--optimizer.warmup_steps", "2"]
    cfg = parse_config(base + list(flags)).validate(dist.get_world_size())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer = Trainer(build_run(cfg, init_distributed()))
        try:
            trainer.train()
        finally:
            trainer.grid.close()
    try:
        setup = memory_model.fullest_stage_setup(cfg, trainer.mcfg, 2, backend="gloo", device="cpu")
        predicted = memory_model.estimate(setup)["before_margin"]
    except ValueError:
        predicted = None
    return {"text": out.getvalue(), "params": sum(p.numel() for p in trainer.model.parameters()),
            "total": trainer.mcfg.exact_num_params(1), "predicted": predicted}


def _both(cache: str, tmp: str) -> list[dict]:
    for var in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR", "XDG_CACHE_HOME", "WANDB_DIR"):
        os.environ.pop(var, None)
    os.environ["HOME"] = f"{tmp}/home"
    # wandb's temporary folders (wandb-media, wandb-artifacts), which a rank's os._exit never
    # removes, go into the test's directory rather than the system's
    os.environ["TMPDIR"] = tempfile.tempdir = f"{tmp}/tmp"
    os.makedirs(tempfile.tempdir, exist_ok=True)
    tb = ["--logging.tensorboard", "true"] if _has_tensorboard() else []
    return [_run(cache, tmp, "dp", "--save", f"{tmp}/ck", "--wandb-mode", "offline", *tb),
            _run(cache, tmp, "pp", "--pp", "2", "--save", "none", "--wandb-mode", "disabled", "--precision", "bf16",
                 "--zero.stage", "1", "--zero.contiguous_gradients", "false")]


def _has_tensorboard() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


@pytest.fixture(scope="module")
def runs(zerotron_cache, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runlog")
    return tmp, spawn(_both, 2, zerotron_cache, str(tmp), timeout=240)


def test_banner_states_layout_parameters_and_the_memory_models_prediction(runs):
    _, ranks = runs
    dp, pp = ranks[0]
    assert "world 2 = TP 1 x PP 1 x DP 2 | ZeRO stage 2 (Pos+g) | precision fp32" in dp["text"], dp["text"]
    assert f"parameters {count(dp['total'])} total, {count(dp['params'])} per rank" in dp["text"]
    assert f"predicted memory per rank: {dp['predicted'] / 2**20:,.1f} MiB" in dp["text"]
    assert "batch 4 = micro 2 x DP 2 x 1 accumulation | 64 tokens per step, 4 steps = 256 tokens" in dp["text"]
    # the two pipeline stages hold different parameters: the banner gives both ends
    lo, hi = sorted(r[1]["params"] for r in ranks)
    assert lo != hi and f"{count(lo)}-{count(hi)} (by pipeline stage) per rank" in pp["text"], pp["text"]
    # a pipeline's banner predicts its fullest stage (estimate/pipeline_memory.py)
    predicted = f"predicted memory per rank: {pp['predicted'] / 2**20:,.1f} MiB"
    assert predicted in pp["text"], pp["text"]
    assert "precision fp32 (gradients accumulate in fp32)" in dp["text"]
    # no flat buffer at stage 1 without MD: autograd sums the two micro-batches in bf16 .grad
    assert ("precision bf16 (gradients accumulate in bf16 over micro-batches, reduced in fp32: "
            "zero.contiguous_gradients is off)") in pp["text"], pp["text"]
    assert ranks[1][0]["text"] == "" and ranks[1][1]["text"] == ""  # only rank 0 prints


def test_log_lines_carry_step_of_total_elapsed_and_eta(runs):
    text = runs[1][0][0]["text"]
    lines = [ln for ln in text.splitlines() if ln.startswith("step ")]
    assert [ln.split(" |")[0] for ln in lines] == ["step 2/4", "step 4/4"], text
    for ln in lines:
        assert re.search(r"\| elapsed \d+:\d\d:\d\d \| ETA \d+:\d\d:\d\d$", ln), ln
    assert lines[-1].endswith("ETA 0:00:00")


def test_summary_names_a_checkpoint_only_when_one_was_written(runs):
    tmp, ranks = runs
    dp, pp = ranks[0]
    assert "[zerotron] summary: done at step 4 of 4; 4 steps this run, 256 tokens, loss " in dp["text"]
    assert "peak memory per rank (max over 2 ranks): tensors " in dp["text"]
    assert "MFU unknown (no peak TFLOP/s known for cpu" in dp["text"]
    assert f"last checkpoint: {tmp}/ck/step_00000004 (written by this run)" in dp["text"], dp["text"]
    assert (tmp / "ck" / "step_00000004" / "metadata.json").is_file()
    assert "checkpoints: none (checkpoint.save is not set)" in pp["text"] and "last checkpoint" not in pp["text"]


def test_wandb_records_the_resolved_model_and_keeps_its_files_in_the_run_dir(runs):
    tmp, ranks = runs
    (record,) = glob.glob(str(tmp / "dp" / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = Path(record).read_bytes()  # the config is stored as JSON text inside the record file
    assert b'"num_layers":4,"hidden_size":64,"num_heads":4,"vocab_size":1024,"seq_length":16' in data
    assert f'"total":{ranks[0][0]["total"]}'.encode() in data
    assert glob.glob(str(tmp / "dp" / "wandb" / "cache" / "**" / "core-debug-*.log"), recursive=True)
    assert not (tmp / "home" / ".cache" / "wandb").exists(), list((tmp / "home").rglob("*"))


def test_tensorboard_gets_the_logged_scalars(runs):
    if not _has_tensorboard():
        pytest.skip("the tensorboard package is not installed (pip install -e .[dev] installs it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, _ = runs
    acc = EventAccumulator(str(tmp / "dp" / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [2, 4]
    assert "tokens_per_s" in acc.Tags()["scalars"]


def test_tensorboard_without_the_package_is_a_config_error(monkeypatch):
    import importlib.util

    from zerotron.config.cli import parse_config
    from zerotron.config.run_config import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match="logging.tensorboard=true needs the tensorboard package"):
        parse_config(["--logging.tensorboard", "true"]).validate(1)


def test_durations_and_counts_read_as_a_person_writes_them():
    assert duration(0) == "0:00:00" and duration(3725.4) == "1:02:05" and duration(90061) == "1d 01:01:01"
    assert count(999) == "999" and count(273_792) == "273,792" and count(1_234_567) == "1.23M"
    assert count(1.5e11) == "150.00B"
