"""configs/tiny-llama.yaml end to end on gloo ranks, and checkpoints that name their architecture.

The trainer on the built-in corpus, shortened as tests/training/test_trainer.py shortens
configs/tiny.yaml (seq 32, global batch 8), in float64 (the tier of tests/parity.py): TP 2 x DP 2
with ZeRO-1, 2 and 3 (GQA's query groups and the untied vocab-parallel head split over TP, every
parameter partitioned) and PP 2 x DP 2 with ZeRO-1 (the untied head on the last stage, no tied
copy to sync) give the single process's 20 losses to ``FP64_TP_PP`` (document masking off: pipelines
refuse it). Reference: that single
process (one rank, no partition, no collective), itself checked to learn.

A checkpoint's metadata says which architecture it holds; loading it into another is refused
naming the fields that differ, and one written before those fields existed reads as GPT-2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness import spawn
from tests.parity import FP64_TP_PP, assert_fp64
from tests.training.test_trainer import fp64

ROOT = Path(__file__).resolve().parents[2]


def run_llama(run_dir, cache, steps, flags):
    import torch
    import torch.distributed as dist

    from zerotron.parallel.runtime import init_distributed
    from zerotron.config.cli import last_wins, parse_config
    from zerotron.training.build_run import build_run
    from zerotron.training.trainer import Trainer

    base = ["--config", str(ROOT / "configs" / "tiny-llama.yaml"), "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--train-steps", str(steps),
            "--wandb-mode", "disabled", "--log-interval", "100", "--eval-interval", "0",
            "--run-dir", str(run_dir), "--data.cache_dir", cache, "--save", "none",
            "--optimizer.warmup_steps", "5", "--tp", "1", "--precision", "fp64"]
    cfg = parse_config(last_wins(base + [str(f) for f in flags])).validate(dist.get_world_size())
    trainer = Trainer(build_run(cfg, init_distributed()))
    assert trainer.mcfg.architecture == "llama"
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float64}
    return [float(trainer.train_step()["loss"]) for _ in range(steps)]


# document masking is refused with pipelines (its layout does not travel between stages yet), so the
# layouts run without it; tests/model/test_document_masking.py holds it to each document alone
UNMASKED = ["--model.reset_attention_mask", "false", "--model.reset_position_ids", "false"]


@pytest.fixture(scope="module")
def single_process(tmp_path_factory, zerotron_cache):
    run_dir = tmp_path_factory.mktemp("ref")
    return spawn(run_llama, 1, run_dir, zerotron_cache, 20, UNMASKED, timeout=240)[0]


@pytest.mark.parametrize("flags", [["--tp", "2", "--zero-stage", "1"],
                                   ["--tp", "2", "--zero-stage", "2"],
                                   ["--tp", "2", "--zero-stage", "3"],
                                   ["--pp", "2", "--zero-stage", "1"]],
                         ids=["tp2-dp2-zero1", "tp2-dp2-zero2", "tp2-dp2-zero3", "pp2-dp2-zero1"])
def test_layouts_give_the_single_process_losses(flags, single_process, zerotron_cache, tmp_path):
    assert single_process[-1] < single_process[0] - 0.5  # it learns
    runs = spawn(run_llama, 4, tmp_path, zerotron_cache, 20, flags + UNMASKED, timeout=240)
    for rank, losses in enumerate(runs):
        what = f"{' '.join(flags)} rank {rank} losses"
        assert_fp64(fp64(losses), fp64(single_process), FP64_TP_PP, what)


def test_a_checkpoint_refuses_another_architecture():
    import dataclasses

    from zerotron.model import get_preset
    from zerotron.checkpoint.distributed import CheckpointError, check_compatible
    from zerotron.checkpoint.export import saved_architecture

    llama, gpt2 = get_preset("tiny-llama"), get_preset("tiny")
    meta = {"model": {**dataclasses.asdict(llama), "architecture": "llama"}, "params": {}}
    with pytest.raises(CheckpointError, match=r"another architecture \(llama\): "
                       r"model.position_embedding_type='rope' in the checkpoint, 'learned' in"):
        check_compatible(meta, dataclasses.asdict(gpt2), {})
    check_compatible(meta, dataclasses.asdict(llama), {})
    shape = ("num_layers", "hidden_size", "num_heads")
    old = {k: v for k, v in dataclasses.asdict(gpt2).items() if k in shape}
    assert saved_architecture(old) == "gpt2" and saved_architecture(meta["model"]) == "llama"
    with pytest.raises(CheckpointError,
                       match="model.normalization='LayerNorm' in the checkpoint, 'RMSNorm'"):
        check_compatible({"model": old, "params": {}}, dataclasses.asdict(llama), {})


def run_yaml_as_is(run_dir, cache, steps):
    """configs/tiny-llama.yaml as written (TP 2 x DP 2, ZeRO-2, document masking on)."""
    import math

    import torch.distributed as dist

    from zerotron.parallel.runtime import init_distributed
    from zerotron.config.cli import parse_config
    from zerotron.training.build_run import build_run
    from zerotron.training.trainer import Trainer

    argv = ["--config", str(ROOT / "configs" / "tiny-llama.yaml"), "--train-steps", str(steps),
            "--wandb-mode", "disabled", "--eval-interval", "0", "--run-dir", str(run_dir),
            "--data.cache_dir", cache, "--save", str(run_dir / "checkpoints")]
    cfg = parse_config(argv).validate(dist.get_world_size())
    trainer = Trainer(build_run(cfg, init_distributed()))
    m = trainer.mcfg
    assert m.reset_attention_mask and m.reset_position_ids
    assert m.eod_token_id == 2  # the built-in tokenizer's
    losses = [float(trainer.train_step()["loss"]) for _ in range(steps)]
    assert all(math.isfinite(x) for x in losses)
    saved = json.loads((trainer.save() / "metadata.json").read_text())
    assert saved["model"]["architecture"] == "llama"  # the checkpoint names the family it holds
    return losses


def test_the_yaml_runs_as_written_on_four_ranks(zerotron_cache, tmp_path):
    losses = spawn(run_yaml_as_is, 4, tmp_path, zerotron_cache, 3, timeout=240)
    assert all(r == losses[0] for r in losses)  # every rank reports the same DP-averaged loss
