"""The dry run (scripts/dry_run.py) on 8 simulated ranks, TP 2 x PP 2 x DP 2, on the fake CUDA device.

The counts below are derived by hand from the model and the parallel plan, not read from the
code: a test of what the real step communicates and how often it stops for the host.

Per micro-batch of b x s tokens and hidden h on a stage of n blocks (CommStats volumes: an
all-reduce of N elements counts 2N, an all-gather of an N-element result N):

* TP all-reduce: 2 per block forward (g after the attention and MLP output projections), 2 again
  in the recomputed forward, 2 backward (f before QKV and fc1): 6 · 2bsh per block. The first
  stage adds the vocab-parallel embedding's forward all-reduce (2bsh), the last the head's f
  backward (2bsh) and the vocab-parallel cross-entropy's three per-token all-reduces (max, sum of
  exponentials, target logit: 3 · 2bs).
* TP all-gather (Pa): each block's checkpoint is gathered once, for its recompute: bsh.
* DP: the gradient reduce-scatter and the parameter all-gather, Ψ elements each (2Ψ, ZeRO §7);
  under a pipeline, stage 2 reduce-scatters every micro-batch's gradients as its backward ends
  (Pos+g holds no full gradient between micro-batches): m·Ψ.
* host syncs per step: none in bf16; fp16's overflow decision is the one read (the trainer adds
  its SIGTERM agreement, outside ``run_step``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
B, S, H, VOCAB, LAYERS, MICRO = 8, 128, 64, 1024, 4, 2  # configs/tiny.yaml, global 32 / (8 x DP 2)


def run_script(tmp_path, *flags: str) -> dict:
    """``scripts/dry_run.py --json`` on configs/tiny.yaml with ``flags``; its JSON (exit 0 asserted).

    With a system temp dir of its own, which the run must leave as it found it: torch's compiler
    cache goes under ``data.cache_dir`` (``runtime.keep_compiler_cache_in``)."""
    systmp, cache = tmp_path / "systmp", tmp_path / "cache"
    systmp.mkdir()
    cmd = [sys.executable, str(ROOT / "scripts" / "dry_run.py"), "--config", str(ROOT / "configs" / "tiny.yaml"),
           "--json", "--out", str(tmp_path), "--data.cache_dir", str(cache), *flags]
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"} | {"TMPDIR": str(systmp)}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not any(systmp.iterdir()), sorted(p.name for p in systmp.iterdir())
    assert (cache / "torchinductor").is_dir()
    return json.loads(proc.stdout)


def dry_run(tmp_path, precision: str, stage: int) -> dict:
    return run_script(tmp_path, "--gpus", "8", "--ranks", "0", "7", "--parallel.tp", "2", "--parallel.pp", "2",
                      "--training.precision", precision, "--zero.stage", str(stage),
                      "--activation_checkpointing.checkpoint_activations", "true",
                      "--activation_checkpointing.partition_activations", "true", "--model.vocab_size", str(VOCAB))


@pytest.mark.parametrize("precision,stage", [("bf16", 2), ("fp16", 1)])  # both precisions, both stages
def test_tp2_pp2_dp2(tmp_path, precision, stage):
    out = dry_run(tmp_path, precision, stage)
    assert out["world"] == 8
    bsh, bs, blocks = B * S * H, B * S, LAYERS // 2
    for rank, first in (("0", True), ("7", False)):
        e = out["ranks"][rank]
        assert e["device"] == "cuda:0", e["device"]  # the step ran on the (fake) GPU, not the host
        assert e["coords"]["pp"] == (0 if first else 1)
        ops = e["comm_ops"]
        edge = 2 * bsh if first else 2 * bsh + 3 * 2 * bs
        assert ops["all_reduce/tp"]["elements"] == MICRO * (blocks * 6 * 2 * bsh + edge)
        assert ops["all_reduce/tp"]["calls"] == MICRO * (blocks * 6 + (1 if first else 4))
        assert ops["all_gather/tp"]["elements"] == MICRO * blocks * bsh
        psi = e["num_params"]
        reduced = MICRO * psi if stage == 2 else psi  # tiny's chunks need no padding at DP 2
        assert ops["reduce_scatter/dp"]["elements"] == reduced
        assert ops["all_gather/dp"]["elements"] == psi
        assert ops["reduce_scatter/dp"]["bytes"] == 4 * reduced  # fp32 gradient accumulation (the default)
        assert ops["all_gather/dp"]["bytes"] == 2 * psi  # 16-bit parameters
        # the tied word embedding's gradient (this TP rank's vocab half), summed over the first and
        # last stage once per step: whole at stage 1, this DP rank's reduced half at stage 2
        emb = (VOCAB // 2) * H
        assert ops["all_reduce/embedding"]["elements"] == 2 * (emb // 2 if stage == 2 else emb)
        want = {"bf16": {}, "fp16": {"overflow": 1.0}}[precision]
        assert e["host_sync_reasons"] == want
        assert e["host_syncs_per_step"] == sum(want.values())
        assert e["host_tensor_bytes_per_step"] == 0
        assert e["fits"] and 0 < e["peak_bytes"] < 32e9
        # on the (fake) GPU each group is an NCCL communicator; the embedding pair is the pp group
        assert e["nccl_groups"] == {"tp": 2, "dp": 2, "pp": 2, "mp": 4, "world": 8}
        assert 1e9 < e["nccl_communicators"] < 32e9 - e["peak_bytes"]  # in ``fits``
        for category in ("parameters", "gradients", "optimizer_states"):
            assert e["by_category"][category] > 0
    meta = json.loads((tmp_path / "tiny-8gpus" / "checkpoint" / "rank_00007.json").read_text())
    assert meta["rank"] == 7 and meta["index"] and "master" in meta["tensors"]


def test_fp32_model_states_are_16_psi(tmp_path):
    """fp32 parameters are their own masters: parameters, gradients and Adam's two moments, 16Ψ,
    as the live storages of a stage-0 step show -- not the mixed-precision 4Ψ + 12Ψ."""
    from zerotron.estimate.memory_model import model_state_bytes

    e = run_script(tmp_path, "--gpus", "2", "--ranks", "0", "--parallel.tp", "1", "--training.precision", "fp32",
                   "--zero.stage", "0")["ranks"]["0"]
    measured = sum(e["by_category"][c] for c in ("parameters", "gradients", "optimizer_states"))
    assert measured == 16 * e["num_params"], (e["by_category"], e["num_params"])
    assert model_state_bytes(e["num_params"], 2, 0, param_bytes=4, grad_bytes=4) == measured


def test_bad_rank_exits_2(tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts" / "dry_run.py"), "--config", str(ROOT / "configs" / "tiny.yaml"),
           "--gpus", "8", "--ranks", "8", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "--ranks [8]" in proc.stderr


def test_offloads_on_fake_cuda(tmp_path):
    """The host-memory paths a GPU run takes -- stage 3's host partition, Pa+cpu's copies,
    ZeRO-Infinity's NVMe tier -- on the fake CUDA device: they run, their host tensors are allowed
    because they are on purpose, and the NVMe tier (which has no values to write) makes no file or directory."""
    nvme = tmp_path / "nvme"
    out = run_script(tmp_path, "--gpus", "4", "--ranks", "0", "--parallel.tp", "2",
                     "--zero.stage", "3", "--zero.offload_param_device", "cpu", "--zero.offload_optimizer_device", "nvme",
                     "--zero.offload_optimizer_nvme_path", str(nvme),
                     "--activation_checkpointing.checkpoint_activations", "true",
                     "--activation_checkpointing.partition_activations", "true",
                     "--activation_checkpointing.cpu_checkpointing", "true")
    e = out["ranks"]["0"]
    assert e["device"] == "cuda:0" and e["host_tensor_bytes_per_step"] > 0, e
    assert not nvme.exists(), sorted(nvme.rglob("*"))


def test_a_deepspeed_json_batch_is_sized_by_gpus(tmp_path, monkeypatch):
    """The JSON's batch triple is resolved against the simulated world (``--gpus``), not the
    launching process's one."""
    import scripts.dry_run as dry

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}))
    a, overrides = dry.build_parser().parse_known_args(
        ["--config", str(ROOT / "configs" / "tiny.yaml"), "--gpus", "8", "--parallel.tp", "2",
         "--deepspeed-config", str(ds)])
    cfg, _, _ = dry.load(a, overrides)
    assert (cfg.parallel.dp, cfg.training.micro_batch_size, cfg.training.global_batch_size) == (4, 4, 4 * 2 * 4)


def test_zeropp_with_sequence_parallel_in_fp16_on_fake_cuda(tmp_path):
    """ZeRO++ (qwZ, qgZ, hpZ over 4-GPU nodes) with TP 2 x SP in fp16: the configurations the other
    dry runs here leave out, under the device-mixing check and the cuda-only fake group."""
    out = run_script(tmp_path, "--gpus", "8", "--ranks", "0", "--gpus-per-node", "4",
                     "--parallel.tp", "2", "--parallel.sequence_parallel", "true",
                     "--training.precision", "fp16", "--zero.stage", "3",
                     "--zero.zero_quantized_weights", "true",
                     "--zero.zero_quantized_gradients", "true",
                     "--zero.zero_hpz_partition_size", "2",
                     "--activation_checkpointing.checkpoint_activations", "true")
    ops = set(out["ranks"]["0"]["comm_ops"])
    assert {"all_to_all/dp_inner", "all_to_all/dp_outer", "reduce_scatter/tp"} <= ops, sorted(ops)
