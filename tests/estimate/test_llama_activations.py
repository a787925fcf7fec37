"""The memory model's Llama-family layer (``estimate.activations.llama_extra_bytes`` on top of
Korthikanti's Table 2) against what autograd saves and the allocator frees, measured by
``zerotron.testing.activation_bytes`` (saved-tensor hooks and storage births: no shared code),
on TP 2 for every row of the manual's table: no recompute, SP, selective, SP + selective, full,
full + Pa, full + SP, Pa+cpu; GQA 2:1, SwiGLU, RMSNorm, RoPE, with and without document
masking (CPU: SDPA's dense mask), in fp32 and bf16. GPT-2's rows are
``tests/activation/test_selective_recompute.py``'s.
"""

import torch

from tests.harness import spawn
from zerotron.model.presets import get_preset
from zerotron.parallel import Grid, ParallelDims

B, S = 2, 32


def _packed_ids(cfg) -> torch.Tensor:
    """Two samples of several documents each, ended by ``eod_token_id`` (0) at fixed places."""
    ids = torch.arange(1, B * S + 1).reshape(B, S) % cfg.vocab_size + 1
    ids[0, [5, 17]], ids[1, [11]] = 0, 0
    return ids


def check_rows(grid, documents: bool, dtype) -> dict:
    from zerotron.estimate.activations import (layer_activation_bytes, llama_extra_bytes,
                                               norm_stats_bytes)
    from zerotron.testing.activation_bytes import ROWS, measure_row

    torch.set_num_threads(1)
    cfg = get_preset("tiny-llama", num_layers=1, seq_length=S, reset_attention_mask=documents,
                     reset_position_ids=documents, eod_token_id=0)
    e, t, h = torch.finfo(dtype).bits // 8, grid.tp_size, cfg.hidden_size
    ids = _packed_ids(cfg) if documents else None
    out = {}
    for name, (sp, fields) in ROWS.items():
        got = measure_row(name, cfg, grid, B, dtype=dtype, input_ids=ids)
        full = fields.get("checkpoint_activations", False)
        recompute = "full" if full else fields.get("recompute_granularity", "none")
        want = layer_activation_bytes(B, S, h, cfg.num_heads, t, sp, recompute, ffn=cfg.ffn_size,
                                      fused_attention=True, act_bytes=e, mask_bytes=0,
                                      partition_activations=fields.get("partition_activations",
                                                                       False))
        held = want + llama_extra_bytes(cfg, B, t, sp, recompute, e, cpu=True)  # the allocator's
        want += llama_extra_bytes(cfg, B, t, sp, recompute, e, cpu=True, storages=False)
        if full:  # the checkpoint lives outside autograd: only the allocator sees it
            assert got["saved"] == 0 and got["freed"] == want == held, (name, got, want)
        else:
            stats = norm_stats_bytes(cfg, B, t, sp, e, recompute)
            assert got["saved"] == want + stats, (name, documents, dtype, got, want + stats)
            assert got["freed"] == held + stats, (name, documents, dtype, got, held + stats)
        out[name] = got["saved"] or got["freed"]
    return out


def check_all():
    grid = Grid(ParallelDims(tp=2))
    plain = check_rows(grid, False, torch.float32)
    packed = check_rows(grid, True, torch.float32)
    check_rows(grid, True, torch.bfloat16)
    return plain, packed


def test_llama_layer_activations_tp2():
    plain, packed = spawn(check_all, 2, timeout=120)[0]
    assert packed["none"] > plain["none"]  # the dense mask and per-sample RoPE tables
    # selective: per-sample RoPE tables only, the mask is made again in the recompute
    assert packed["selective"] > plain["selective"]


def test_tiny_llama_dry_run_is_within_5_percent_of_the_model(tmp_path, zerotron_cache):
    """configs/tiny-llama.yaml's rank 0 on the dry run's fake GPU: the MemoryTracker's peak (the
    allocator's storages, no code shared with the memory model) against the model's bytes."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, str(root / "scripts" / "dry_run.py"), "--config",
           str(root / "configs" / "tiny-llama.yaml"), "--gpus", "4", "--ranks", "0", "--json",
           "--out", str(tmp_path), "--data.cache_dir", zerotron_cache]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank = next(iter(json.loads(proc.stdout)["ranks"].values()))
    assert 0.95 <= rank["measured_vs_model"] <= 1.05, rank["measured_vs_model"]
