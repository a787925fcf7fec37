"""The memory model (zerotron.estimate.memory_model) against the ZeRO paper and against our own runs.

* Table 1 (§5.4) and Table 2's theoretical columns (§7) as printed by the estimator equal the
  paper's values digit for digit (the values below are copied from the paper).
* Measured on gloo CPU (layouts TP 1 x DP 2 and TP 1 x DP 4, a 3-layer fp16 GPT, one step):
  the model states ``ZeroOptimizer.memory_report()`` holds per rank for stages 0-3 equal the
  paper's formulas within 5% (in fact to the byte), the per-rank Ψ equals
  ``params_per_rank`` and the CB buffers equal ``fixed_buffer_bytes``.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import spawn
from zerotron.model import get_preset
from zerotron.estimate.memory_model import (Setup, checkpoint_bytes, estimate, max_layers, model_state_bytes,
                                            params_per_rank)
from zerotron.estimate.working_memory import fixed_buffer_bytes
from zerotron.estimate.paper_tables import c_config_max_models, table1_text, table2_text

ROOT = Path(__file__).resolve().parents[2]
PAPER_TABLE1 = """\
1 120 120 120 2048 2048 2048 16000 16000 16000
4 52.5 41.3 30 896 704 512 7000 5500 4000
16 35.6 21.6 7.5 608 368 128 4750 2875 1000
64 31.4 16.6 1.88 536 284 32 4187 2218 250
256 30.4 15.4 0.47 518 263 8 4046 2054 62.5
1024 30.1 15.1 0.12 513 257 2 4011 2013 15.6"""
PAPER_TABLE2 = """\
1 64 2B 7.6B 14.4B 128B
2 128 4B 15.2B 28.8B 256B
4 256 8B 30.4B 57.6B 0.5T
8 512 16B 60.8B 115.2B 1T
16 1024 32B 121.6B 230.4B 2T"""


def test_table1_equals_paper():
    assert [" ".join(r) for r in table1_text()[1:]] == PAPER_TABLE1.splitlines()


def test_table2_theoretical_columns_equal_paper():
    assert [" ".join(r) for r in table2_text()[1:]] == PAPER_TABLE2.splitlines()


def test_estimator_prints_the_tables_and_json():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "estimate_memory.py"), "--preset", "zero-100b",
                          "--gpus", "400", "--tp", "16", "--config-name", "C4", "--c-batches", "4"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    assert "4187" in out and "15.6" in out and "121.6B" in out and "0.5T" in out
    assert "largest GPT that fits" in out and "C5" in out


def test_terms_follow_the_paper():
    # Pa divides the checkpoints by MP (§6.1: 33 GB -> 2 GB at MP 16), Pa+cpu moves them to the host
    plain = checkpoint_bytes(32, 1024, 8192, 125, tp=16)
    pa = checkpoint_bytes(32, 1024, 8192, 125, tp=16, pa=True)
    cpu = checkpoint_bytes(32, 1024, 8192, 125, tp=16, pa=True, cpu=True)
    assert plain["device"] == 16 * pa["device"] and cpu == {"device": 0, "host": pa["device"]}
    # §1: 1T parameters need 16 TB of model states, 15.6 GB/GPU with Pos+g+p on 1024 GPUs
    assert model_state_bytes(1e12, 1024, 3) == pytest.approx(15.625e9)
    # MP splits the replica: Ψ per rank ≈ Ψ / MP for the 100B model
    cfg = get_preset("zero-100b")
    assert params_per_rank(cfg, 16) == pytest.approx(cfg.exact_num_params(16) / 16, rel=0.01)
    # more memory never fits fewer layers; the C-configs rank as their terms say at batch 4
    base = Setup(cfg, tp=16, dp=25, micro_batch=4)
    assert max_layers(base, 64e9) >= max_layers(base, 32e9) > 0
    c = {k: v["params"] for k, v in c_config_max_models(micro_batch=4).items()}
    assert c["baseline"] < c["C1"] < c["C2"] < c["C3"] < c["C4"] <= c["C5"]
    e = estimate(base.with_config("C5"))
    assert e["checkpoints_device"] == 0 and e["checkpoints_host"] > 0


def test_cpu_only_terms_are_torchs_sizes():
    """The RNG snapshot is torch's own generator state, and only a CPU device holds it (with its
    host checkpoints); a dropout of 0 keeps no mask (torch returns the input)."""
    import dataclasses

    import torch

    from zerotron.estimate.working_memory import CPU_GENERATOR_STATE_BYTES, dropout_mask_bytes

    assert torch.get_rng_state().numel() == CPU_GENERATOR_STATE_BYTES
    x = torch.ones(4, requires_grad=True)
    assert torch.nn.functional.dropout(x, 0.0, training=True) is x
    cfg = get_preset("zero-100b")  # dropout 0.1: a byte mask on a GPU, the activation dtype on a CPU
    gpu = Setup(cfg, tp=16, dp=25, micro_batch=4, partition_activations=True, cpu_checkpointing=True)
    assert dropout_mask_bytes(gpu, 2) == 1 and dropout_mask_bytes(dataclasses.replace(gpu, device="cpu"), 2) == 2
    gpu = dataclasses.replace(gpu, model=dataclasses.replace(cfg, dropout=0.0))
    cpu = dataclasses.replace(gpu, device="cpu")
    assert dropout_mask_bytes(gpu, 2) == dropout_mask_bytes(cpu, 2) == 0
    eg, ec = estimate(gpu), estimate(cpu)
    assert eg["rng_states"] == 0 and ec["rng_states"] == (3 * cfg.num_layers + 2) * CPU_GENERATOR_STATE_BYTES
    assert ec["before_margin"] - eg["before_margin"] == ec["rng_states"] + ec["checkpoints_host"] > 0


def _measure(layers: int):
    import torch

    from zerotron.model import GPT, GPTConfig
    from zerotron.parallel import Grid, ParallelDims
    from zerotron.zero import ZeroConfig, ZeroOptimizer

    grid = Grid(ParallelDims())
    cfg = GPTConfig(num_layers=layers, hidden_size=32, num_heads=4, vocab_size=256, seq_length=32,
                    make_vocab_size_divisible_by=64)
    out = {}
    for stage in (0, 1, 2, 3):
        model = GPT(cfg, grid)
        opt = ZeroOptimizer(model, grid, ZeroConfig(stage=stage, reduce_bucket_size=4096, allgather_bucket_size=4096,
                                                    stage3_param_persistence_threshold=0).validate(),
                            precision="fp16")
        ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(grid.dp_rank))
        opt.backward(model(ids, ids))
        opt.step()
        out[stage] = (opt.num_params, opt.memory_report())
    return cfg, out


@pytest.mark.parametrize("nd", [2, 4])
def test_measured_model_states_follow_the_formulas(nd):
    cfg, out = spawn(_measure, nd, 3, timeout=120)[0]
    for stage, (psi, mem) in out.items():
        assert psi == params_per_rank(cfg, 1)
        want = model_state_bytes(psi, nd, stage, grad_bytes=4)  # fp16 params, fp32-accumulated gradients
        assert abs(mem["total_model_states"] - want) <= 0.05 * want, (nd, stage, mem, want)
        assert mem["fixed_buffers"] == fixed_buffer_bytes(stage, 4096, nd, psi, grad_bytes=4), (nd, stage, mem)
    cut = [out[s][1]["total_model_states"] for s in (0, 1, 2, 3)]
    assert cut == sorted(cut, reverse=True)  # each stage partitions one more state (§5)
