"""Context parallelism in the estimates: the collectives a CP rank issues per step, counted by
the collective counters of a simulated rank (``training.dry_run.simulate_rank``: the real model,
ring and ZeRO on fake tensors), equal ``comm_volumes.analytic_comm`` -- the ring's K/V and dK/dV
transfers (``ring_comm``), the TP all-reduces at s/cp tokens and ZeRO's collectives over DP x
CP; and the memory model's CP terms scale as the layout says."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from zerotron.estimate.comm_volumes import analytic_comm, ring_comm
from zerotron.estimate.memory_model import Setup, estimate
from zerotron.model import get_preset

RECOMPUTE = "--activation_checkpointing.checkpoint_activations"
LAYOUTS = {  # world 4: (overrides, rank simulated)
    "tp2-cp2-llama-bf16-recompute": (["--config", "configs/tiny-llama.yaml", "--parallel.tp", "2",
                                      "--parallel.cp", "2", "--zero.stage", "1",
                                      "--training.precision", "bf16", RECOMPUTE, "true"], 3),
    "cp2-dp2-gpt2-zero2": (["--config", "configs/tiny.yaml", "--parallel.tp", "1",
                            "--parallel.cp", "2", "--zero.stage", "2",
                            "--model.vocab_size", "1024"], 2),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_counted_cp_traffic_equals_the_formula(name):
    from zerotron.config.cli import parse_config
    from zerotron.training.dry_run import simulate_rank
    from zerotron.training.setup_run import validate_model

    torch.set_num_threads(1)
    args, rank = LAYOUTS[name]
    cfg = parse_config(args + ["--training.global_batch_size", "2",
                               "--training.micro_batch_size", "1", "--model.seq_length", "64"],
                       world_size=4)
    cfg.validate(4)
    mcfg = validate_model(cfg)
    measured = simulate_rank(cfg, mcfg, 4, rank, device_kind="cpu").comm_ops
    counted = analytic_comm(cfg, mcfg)
    big = {k: {"calls": v["calls"], "bytes": v["bytes"]}
           for k, v in measured.items() if v["bytes"] > 64}  # scalars: norm, loss, token count
    assert counted == big
    assert counted["send/cp"]["bytes"] > 0


def test_ring_bytes_by_hand():
    """Llama-3.1 8B, seq 131,072, TP 8 x CP 8, bf16, full recompute, one micro-batch: a K/V pair of
    2 x 16,384 tokens x 1 query group (8 groups / TP 8) x 128 is 4 Mi fp32 values; each layer
    sends it 7 times in forward, 7 in the recompute, 7 in backward, and dK/dV 8 times."""
    from zerotron.config.cli import parse_config
    from zerotron.training.setup_run import validate_model

    cfg = parse_config(["--config", "configs/llama/llama3.1-8b-seq131k-64gpus.yaml",
                        "--training.global_batch_size", "1"], world_size=64)
    cfg.validate(64)
    (key, calls, nbytes), _ = ring_comm(cfg, validate_model(cfg))
    pair = 2 * 16384 * 1 * 128 * 4
    assert (key, calls, nbytes) == ("send/cp", 32 * 29, 32 * 29 * pair)


def test_memory_terms_follow_the_layout():
    """At cp the activations are those of s/cp tokens and the model states those of DP x CP."""
    model = dataclasses.replace(get_preset("llama3.1-8b"), seq_length=32768)
    base = Setup(model, tp=8, dp=1, cp=1, micro_batch=1, stage=1, sequence_parallel=True,
                 precision="bf16")
    cp4 = estimate(dataclasses.replace(base, cp=4))
    short = estimate(dataclasses.replace(base, dp=4,
                                         model=dataclasses.replace(model, seq_length=8192)))
    assert cp4["model_states"] == short["model_states"]  # ZeRO-1 over DP x CP = 4
    assert cp4["checkpoints_device"] == short["checkpoints_device"]  # s/cp tokens per rank
    assert cp4["working"] > short["working"]  # + the ring's buffers and dense block scores


def _cp_memory_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "cp_memory.py"
    spec = importlib.util.spec_from_file_location("cp_memory", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(600)
def test_the_tracker_peak_at_cp_1_2_4_is_the_model_within_five_percent(capsys, tmp_path):
    """``scripts/bench/cp_memory.py`` at seq 1024 (4 gloo ranks, no checkpointing): the allocator
    tracker's peak per rank at CP 1 x DP 4, CP 2 x DP 2 and CP 4 x DP 1 is the memory model's
    within 5%, and the activation peak (the step's peak less what was alive at its start) falls
    as 1/cp within 10%."""
    import json

    _cp_memory_script().main(["--json", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    rows = json.loads(out.strip().splitlines()[-2])
    assert [r["cp"] for r in rows] == [1, 2, 4]
    for r in rows:
        assert abs(r["ratio"] - 1) <= 0.05, out
    for r in rows[1:]:
        assert abs(r["scaled_activations"] - 1) <= 0.10, out


def test_estimate_memory_takes_cp_from_the_flag_and_the_config(capsys):
    """``--cp`` and ``parallel.cp``: the 131k config fits 80 GB with CP 8 and names CP in its
    breakdown; a world or a sequence CP cannot split exits 2 naming the flag and the fix."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
    import estimate_memory

    cfg = "configs/llama/llama3.1-8b-seq131k-64gpus.yaml"
    out = estimate_memory.main(["--config", cfg, "--gpu", "h100", "--c-batches", "4"])
    b = out["breakdown"]
    assert (b["gpus"], b["tp"], b["cp"], b["dp"], b["fits"]) == (64, 8, 8, 1, True)
    assert "MP 8 x CP 8 x DP 1" in capsys.readouterr().out
    by_flag = estimate_memory.main(["--config", cfg, "--cp", "4", "--gpus", "32",
                                    "--c-batches", "4"])
    assert (by_flag["breakdown"]["cp"], by_flag["breakdown"]["gpus"]) == (4, 32)
    capsys.readouterr()
    for argv, said in ((["--cp", "4", "--gpus", "48"],
                        "--gpus 48 is not a multiple of --tp 8 x --cp 4"),
                       (["--cp", "8", "--gpus", "64", "--seq", "1000"],
                        "--cp 8: the sequence (1000)")):
        with pytest.raises(SystemExit) as exit_:
            estimate_memory.main(["--preset", "llama3.1-8b", "--tp", "8", *argv])
        assert exit_.value.code == 2 and said in capsys.readouterr().err


def test_step_model_splits_attention_over_cp_and_hides_the_ring_behind_it():
    """8B at 131k: a CP 8 rank computes 1/8 of the no-CP rank's attention core and per-token
    work on 1/8 of the tokens; the ring's exposed time is what (cp-1)/cp of that attention
    cannot cover."""
    from zerotron.estimate import step_model
    from zerotron.estimate.hardware import HARDWARE
    from zerotron.config.cli import parse_config
    from zerotron.training.setup_run import validate_model

    hw = HARDWARE["h100"]
    runs = {}
    for name, world in (("", 64), ("-nocp", 64)):
        cfg = parse_config(["--config", f"configs/llama/llama3.1-8b-seq131k-64gpus{name}.yaml",
                            "--training.global_batch_size", "8"], world_size=world)
        cfg.validate(world)
        runs[name] = (cfg, step_model.micro_batch_compute(cfg, validate_model(cfg), hw),
                      step_model.predict(cfg, validate_model(cfg), world, hw))
    (cfg, cp8, pred), (_, cp1, _) = runs[""], runs["-nocp"]
    assert cp8["attention"] == pytest.approx(cp1["attention"] / 8, rel=1e-12)
    assert cp8["gemm"] < cp1["gemm"] / 7  # GEMMs on s/8 tokens (the logits too)
    ring = pred.comm_s["cp"]
    assert 0 < ring and pred.exposed_s["cp"] == pytest.approx(
        max(0.0, ring - pred.attention_s * 7 / 8), abs=1e-3 * ring)
