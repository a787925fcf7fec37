"""Activation checkpointing with ZeRO-R Pa, Pa+cpu, CPU offload and MD (ZeRO §6.1, §6.3, §8), fp32, gloo CPU.

Layouts: TP = 2 (2 ranks), TP = 2 x DP = 2 under ZeroOptimizer stage 2 (4 ranks), TP = 1 x DP = 2.
Reference: on every rank, the same GPT (same init seed and same dropout seed, hence the same
weights and masks) run *without* checkpointing. Tier: bitwise (``assert_bitwise``), dropout > 0:
the recompute replays the same kernels on the same shapes with the same RNG streams, Pa's
partition + all-gather and the CPU offload only move the saved input, so the loss, every
gradient, every ZeRO-2 gradient partition, the gradient norm and the parameters after the step
are bit-identical -- no tolerance.
Byte and volume figures are exact for the shapes used (b·s·h = 2·16·32 = 1024, divisible by tp).
"""

import math
import warnings

import pytest
import torch

from tests.harness import spawn
from tests.parity import assert_bitwise
from zerotron.model import GPT, GPTConfig
from zerotron.parallel import Grid, ParallelDims
from zerotron.activation.checkpoint import apply_activation_checkpointing, remove_activation_checkpointing
from zerotron.activation.config import ActivationCheckpointConfig as AC

B, S, H = 2, 16, 32
BSH = B * S * H
MODES = {  # name -> ActivationCheckpointConfig fields (checkpoint_activations=True added)
    "checkpointing": {},
    "checkpointing_k2": {"checkpoint_every": 2},
    "Pa": {"partition_activations": True},
    "Pa+cpu": {"partition_activations": True, "cpu_checkpointing": True},
    "cpu_offload_only": {"cpu_checkpointing": True},
    "Pa+MD": {"partition_activations": True, "contiguous_memory_optimization": True},
    "Pa+cpu+MD": {"partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": True},
    "MD": {"contiguous_memory_optimization": True},
}


def make_cfg(layers=4, dropout=0.1):
    return GPTConfig(num_layers=layers, hidden_size=H, num_heads=4, vocab_size=90, seq_length=S,
                     make_vocab_size_divisible_by=8, dropout=dropout, attention_dropout=dropout)


def data(seed=3, rows=B):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 90, (rows, S), generator=g), torch.randint(0, 90, (rows, S), generator=g)


def check_tp2_modes():
    cfg, grid = make_cfg(), Grid(ParallelDims(tp=2))
    ids, labels = data()
    L = cfg.num_layers

    def run(mode):
        model = GPT(cfg, grid, seed=5)
        handle = apply_activation_checkpointing(model, grid, AC(True, **MODES[mode])) if mode else None
        model.rng.seed(11, grid)
        loss = model(ids, labels)
        after_fwd = handle.memory_report() if handle else None
        gathers = grid.stats.get("all_gather", "tp").elements
        loss.backward()
        gathered = grid.stats.get("all_gather", "tp").elements - gathers
        grads = {n: p.grad for n, p in model.named_parameters()}
        return model, handle, loss.detach(), grads, after_fwd, gathered

    model, _, ref_loss, ref_grads, _, _ = run(None)
    model.eval()
    assert model(ids, labels).item() != ref_loss.item()  # dropout really is on in training
    saved = {}
    for mode in MODES:
        _, handle, loss, grads, fwd, gathered = run(mode)
        assert_bitwise(loss, ref_loss, f"{mode} loss")
        for name, g in ref_grads.items():
            assert_bitwise(grads[name], g, f"{mode} gradient of {name}")
        after = handle.memory_report()
        assert after["checkpoints_live"] == 0 and after["saved_device_bytes"] == after["saved_host_bytes"] == 0
        chunks = L // MODES[mode].get("checkpoint_every", 1)
        assert fwd["checkpoints_live"] == chunks, (mode, fwd)
        saved[mode] = (fwd["saved_device_bytes"], fwd["saved_host_bytes"])
        pa = MODES[mode].get("partition_activations", False)
        # Pa: one all-gather of b·s·h elements per checkpoint, counted on the "tp" group (§8).
        assert gathered == (chunks * BSH if pa else 0) == after["pa_allgather_elements"], (mode, gathered)

    plain = saved["checkpointing"][0]
    assert plain == L * BSH * 4  # one fp32 b·s·h input per checkpointed layer
    assert saved["checkpointing_k2"] == (plain // 2, 0)
    assert saved["Pa"][1] == 0 and math.isclose(saved["Pa"][0], plain / 2, rel_tol=0.02)  # 1/tp
    assert saved["Pa+cpu"] == (0, saved["Pa"][0])  # nothing on the device, the 1/tp piece on the host
    assert saved["cpu_offload_only"] == (0, plain)  # offload without partitioning
    assert saved["Pa+MD"] == saved["Pa"] and saved["Pa+cpu+MD"] == saved["Pa+cpu"] and saved["MD"] == (plain, 0)

    # §8: per block, TP all-reduces with recompute move 12·b·s·h (2 fwd + 2 recompute + 2 bwd, 2Ψ
    # each); Pa adds one b·s·h all-gather: 1/12 of it. Blocks only, one checkpoint per block.
    model = GPT(cfg, grid, seed=5)
    apply_activation_checkpointing(model, grid, AC(True, partition_activations=True))
    x = torch.randn(B, S, H, requires_grad=True)
    mark = grid.stats.snapshot()
    model.run_blocks(x).sum().backward()
    window = grid.stats.since(mark)
    reduce, gather = window.get("all_reduce", "tp"), window.get("all_gather", "tp")
    assert reduce.elements == 12 * BSH * L and gather.elements == BSH * L and gather.calls == L
    assert gather.elements * 12 == reduce.elements
    return saved


def test_tp2_every_mode_equals_no_checkpointing_and_bytes():
    results = spawn(check_tp2_modes, 2, timeout=120)
    assert results[0] == results[1]  # both TP ranks keep the same amount


def check_zero2_tp2_dp2():
    from zerotron.zero import ZeroConfig, ZeroOptimizer

    cfg, grid = make_cfg(layers=2), Grid(ParallelDims(tp=2, dp=2))
    micro = [data(seed, rows=2 * B) for seed in (3, 4)]
    sl = slice(grid.dp_rank * B, (grid.dp_rank + 1) * B)

    def run(mode):
        model = GPT(cfg, grid, seed=5)
        if mode:
            apply_activation_checkpointing(model, grid, AC(True, **MODES[mode]))
        model.rng.seed(11, grid)
        opt = ZeroOptimizer(model, grid, ZeroConfig(stage=2, reduce_bucket_size=3000,
                                                    allgather_bucket_size=3000), lr=1e-2)
        losses = []
        for i, (ids, labels) in enumerate(micro):
            loss = model(ids[sl], labels[sl]) / len(micro)
            opt.backward(loss, last_microbatch=i == len(micro) - 1)
            losses.append(loss.detach())
        shards = [opt.reducer.grad_shard(c).clone() for c in opt.layout.chunks]  # Pos+g partitions
        info = opt.step()
        return torch.stack(losses), shards, info["grad_norm"], [(n, p.detach().clone())
                                                                 for n, p in model.named_parameters()]

    ref_losses, ref_shards, ref_norm, ref_params = run(None)
    for mode in ("checkpointing", "Pa", "Pa+cpu", "cpu_offload_only"):
        losses, shards, norm, params = run(mode)
        assert_bitwise(losses, ref_losses, f"{mode} losses")
        for i, (a, b) in enumerate(zip(shards, ref_shards)):
            assert_bitwise(a, b, f"{mode} gradient partition {i}")
        assert norm == ref_norm, (mode, norm, ref_norm)
        for (name, a), (_, b) in zip(params, ref_params):
            assert_bitwise(a, b, f"{mode} {name} after the step")
    return True


def test_tp2_dp2_zero2_checkpointing_equals_no_checkpointing():
    assert all(spawn(check_zero2_tp2_dp2, 4, timeout=150))


def check_constant_buffers():
    from zerotron.zero import ZeroConfig, ZeroOptimizer

    grid = Grid(ParallelDims(tp=2))
    ids, labels = data()
    out = {}
    for layers in (2, 8):
        model = GPT(make_cfg(layers), grid, seed=5)
        handle = apply_activation_checkpointing(model, grid, AC(True, partition_activations=True,
                                                                contiguous_memory_optimization=True))
        opt = ZeroOptimizer(model, grid, ZeroConfig(stage=2, reduce_bucket_size=4096,
                                                    allgather_bucket_size=4096), lr=1e-2)
        opt.backward(model(ids, labels))
        opt.step()
        rep = handle.memory_report()
        out[layers] = (rep["fixed_buffers"], opt.memory_report()["fixed_buffers"], rep["md_buffer_bytes"])
    (ours2, opt2, md2), (ours8, opt8, md8) = out[2], out[8]
    assert ours2 == ours8 == {"pa_gather_bytes": BSH * 4, "md_slot_bytes": BSH * 4 // 2}  # CB: b·s·h, b·s·h/tp
    assert opt2 == opt8 > 0  # the optimizer's reduce / all-gather buckets (CB)
    assert (md2, md8) == (2 * BSH * 4 // 2, 8 * BSH * 4 // 2)  # MD holds the checkpoints: number_checkpoints slots
    return out[2]


def test_constant_buffers_do_not_grow_with_layers():
    assert spawn(check_constant_buffers, 2, timeout=120)


def check_edges():
    import copy

    grid = Grid(ParallelDims(tp=1))  # 2 ranks: tp = 1, dp = 2
    cfg = make_cfg(layers=2)
    ids, labels = data()
    ref = GPT(cfg, grid, seed=5)
    ref.rng.seed(11, grid)
    ref_loss = ref(ids, labels)
    ref_loss.backward()

    model = GPT(cfg, grid, seed=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = apply_activation_checkpointing(model, grid, AC(True, partition_activations=True,
                                                                contiguous_memory_optimization=True))
        model.rng.seed(11, grid)
        loss = model(ids, labels)
        loss.backward()
    pa_warnings = [w for w in caught if "partition_activations" in str(w.message)]
    assert len(pa_warnings) == 1 and "no-op" in str(pa_warnings[0].message)  # said once, at apply
    assert not handle.memory_report()["partition_activations"]
    assert_bitwise(loss.detach(), ref_loss.detach(), "loss")
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_bitwise(p.grad, q.grad, f"gradient of {n}")

    # A forward whose graph is dropped (no backward) gives its MD slots back.
    model(ids, labels)
    assert handle.memory_report()["checkpoints_live"] == 0 and len(handle.store.buffer.free) == 2
    with torch.no_grad():  # eval: nothing is saved
        out = model(ids, labels)
    assert handle.memory_report()["checkpoints_live"] == 0 and math.isfinite(out.item())
    # A deep copy of the handle shares the grid (process groups cannot be copied), not the store.
    twin = copy.deepcopy(handle)
    assert twin.grid is grid and twin.store is not handle.store and twin.rng is not handle.rng
    # Too few MD slots is a clear error, not silent memory growth.
    small = GPT(cfg, grid, seed=5)
    apply_activation_checkpointing(small, grid, AC(True, contiguous_memory_optimization=True, number_checkpoints=1))
    with pytest.raises(RuntimeError, match="number_checkpoints=1"):
        small(ids, labels)
    remove_activation_checkpointing(small)
    two = apply_activation_checkpointing(small, grid, AC(True, contiguous_memory_optimization=True),
                                         microbatches_in_flight=2)  # e.g. 1F1B: two forwards alive
    first, second = small(ids, labels), small(ids, labels)
    assert two.number_checkpoints == 4 and two.memory_report()["checkpoints_live"] == 4
    (first + second).backward()
    assert two.memory_report()["checkpoints_live"] == 0
    remove_activation_checkpointing(small)
    assert small.block_runner is None and math.isfinite(small(ids, labels).item())
    with pytest.raises(RuntimeError, match="already has a block_runner"):
        apply_activation_checkpointing(model, grid, AC(True))
    assert apply_activation_checkpointing(small, grid, AC()) is None  # off: model untouched
    return True


def test_tp1_pa_noop_said_once_and_slot_lifecycle():
    assert all(spawn(check_edges, 2, timeout=120))


# config -------------------------------------------------------------------------------------------
def test_config_validation_names_field_and_fix():
    assert AC().validate() == AC()
    cases = [(dict(checkpoint_every=0), "checkpoint_every=0"),
             (dict(checkpoint_activations=True, checkpoint_every=True), "checkpoint_every=True"),
             (dict(partition_activations=True), "partition_activations=True: .*checkpoint_activations=true"),
             (dict(cpu_checkpointing=True), "cpu_checkpointing"),
             (dict(checkpoint_activations=True, number_checkpoints=4), "contiguous_memory_optimization=true"),
             (dict(checkpoint_activations=True, contiguous_memory_optimization=True, number_checkpoints=0),
              "number_checkpoints=0"),
             (dict(checkpoint_activations="yes"), "checkpoint_activations='yes': must be true or false")]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            AC(**kw).validate()


def test_from_deepspeed_expresses_c1_to_c5():
    # [Z] Table 3: C1/C3 = CB + MD, C2/C4 = + Pa, C5 = + Pa+cpu (CB is always on: fixed buffers).
    from zerotron.config.deepspeed import from_deepspeed

    def ac(ds: dict) -> AC:
        return from_deepspeed(ds)[0].activation_checkpointing.validate()

    c13 = ac({"zero_optimization": {"stage": 1},
              "activation_checkpointing": {"contiguous_memory_optimization": True, "number_checkpoints": 48}})
    assert (c13.checkpoint_activations, c13.partition_activations, c13.number_checkpoints) == (True, False, 48)
    c24 = ac({"activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": True}})
    assert c24.partition_activations and not c24.cpu_checkpointing
    c5 = ac({"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                          "contiguous_memory_optimization": True,
                                          "synchronize_checkpoint_boundary": False, "profile": False}})
    assert c5.offload_activations and c5.checkpoint_activations
    assert ac({"zero_optimization": {"stage": 2}, "train_batch_size": 8}) == AC()  # no section: off
    assert ac({"activation_checkpointing": {}}).checkpoint_activations  # a bare section: on, as DeepSpeed's users
    with pytest.raises(ValueError, match="activation_checkpointing.partition_activation: .*did you mean "
                                         "partition_activations"):
        ac({"activation_checkpointing": {"partition_activation": True}})


def test_run_config_holds_the_config_itself():
    """The run config's section is ActivationCheckpointConfig, so every key of it can be set."""
    from zerotron.config.cli import parse_config

    cfg = parse_config(["--checkpoint-activations", "--activation_checkpointing.synchronize_checkpoint_boundary",
                        "true"])
    assert isinstance(cfg.activation_checkpointing, AC)
    assert cfg.activation_checkpointing.synchronize_checkpoint_boundary is True
    assert cfg.validate(1).activation_checkpointing.checkpoint_every == 1


# what the trainer logs -----------------------------------------------------------------------------
def _train(run_dir, cache, log_interval):
    import torch.distributed as dist

    from tests.training.test_trainer import make_config
    from zerotron.parallel.runtime import init_distributed
    from zerotron.training.build_run import build_run
    from zerotron.training.trainer import Trainer

    flags = ["--tp", "2", "--checkpoint-activations", "--activation_checkpointing.partition_activations", "true",
             "--log-interval", str(log_interval), "--train-steps", "4"]
    Trainer(build_run(make_config(run_dir, cache, *flags).validate(dist.get_world_size()), init_distributed())).train()


def test_logged_pa_allgather_bytes_are_per_step_whatever_the_log_interval(zerotron_cache, tmp_path):
    """metrics.jsonl's ``pa_allgather_bytes`` sits beside the per-step ``comm_bytes``: it must be
    one step's Pa volume, not the sum over the log window. One step of make_config's run (tiny:
    4 layers, h 64; seq 32, micro-batch 2, 4 micro-batches, fp32) gathers one b·s·h checkpoint
    per layer per micro-batch."""
    import json

    per_step = 2 * 32 * 64 * 4 * 4 * 4
    for interval in (1, 4):
        spawn(_train, 2, tmp_path / str(interval), zerotron_cache, interval, timeout=240)
        lines = (tmp_path / str(interval) / "metrics.jsonl").read_text().splitlines()
        logged = [r["pa_allgather_bytes"] for r in map(json.loads, lines) if "pa_allgather_bytes" in r]
        assert logged == [per_step] * (4 // interval), (interval, logged)
