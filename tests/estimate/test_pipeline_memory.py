"""The memory model of a pipeline stage (``estimate/pipeline_memory.py``) against the dry run's
``MemoryTracker`` (the allocator's storages, no code shared with the model), and its parameter
count against the whole model's; plus full recompute of the Llama block on the fake GPU, whose
SwiGLU backward the fake CUDA library used to decompose into five live temporaries."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zerotron.estimate import memory_model
from zerotron.estimate.pipeline_memory import chunk_layers, stage_params
from zerotron.model.presets import get_preset

ROOT = Path(__file__).resolve().parents[2]
NO_DOCS = ["--model.reset_attention_mask", "false", "--model.reset_position_ids", "false"]


def dry_run(tmp_path, cache, gpus, ranks, *overrides) -> dict:
    cmd = [sys.executable, str(ROOT / "scripts" / "dry_run.py"),
           "--config", str(ROOT / "configs" / "tiny-llama.yaml"), "--gpus", str(gpus),
           "--ranks", *map(str, ranks), "--json", "--out", str(tmp_path),
           "--data.cache_dir", cache, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)["ranks"]


FULL = ["--activation_checkpointing.checkpoint_activations", "true"]


@pytest.mark.parametrize("extra", [[], FULL], ids=["no-recompute", "full-recompute"])
def test_first_and_last_stage_within_5_percent(tmp_path, zerotron_cache, extra):
    """TP 2 x PP 2 x DP 2, ZeRO-1: rank 0 holds the embedding and two micro-batches in flight,
    rank 7 the untied head and one; each is compared with its own stage's figure."""
    ranks = dry_run(tmp_path, zerotron_cache, 8, [0, 7], "--parallel.pp", "2", "--zero.stage", "1",
                    *NO_DOCS, *extra)
    for r, e in ranks.items():
        assert 0.95 <= e["measured_vs_model"] <= 1.05, (r, e["measured_vs_model"])


def test_full_recompute_on_the_fake_gpu_within_5_percent(tmp_path, zerotron_cache):
    """pp = 1, full recompute: 1.13 while the fake CUDA device decomposed ``silu_backward``."""
    ranks = dry_run(tmp_path, zerotron_cache, 4, [0], *FULL)
    e = ranks["0"]
    assert 0.95 <= e["measured_vs_model"] <= 1.05, e["measured_vs_model"]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny", "llama3.1-70b"])
@pytest.mark.parametrize("pp, v", [(2, 1), (2, 2)])
def test_stage_params_sum_to_the_model(name, pp, v):
    """Every stage's Ψ adds up to the model's, plus the last stage's copy of a tied embedding."""
    cfg = get_preset(name)
    setups = [memory_model.Setup(cfg, tp=2, pp=pp, pipeline_rank=r, virtual_stages=v,
                                 microbatches=pp) for r in range(pp)]
    assert sum(sum(chunk_layers(s)) for s in setups) == cfg.num_layers
    copy = cfg.padded_vocab_size(2) * cfg.hidden_size // 2 if cfg.tied else 0
    assert sum(stage_params(s) for s in setups) == memory_model.params_per_rank(cfg, 2) + copy
