"""Selective recompute (Korthikanti et al. 2022 §5) and how the activation toolkit composes, on TP 2.

* selective recompute gives bit-identical gradients to no recompute with dropout on (attention
  and residual), with and without sequence parallelism, alone and inside full recompute, and
  composed with SP + Pa + Pa+cpu; the attention core really runs twice per layer then;
* the bytes a layer keeps, measured (``zerotron.testing.activation_bytes``: autograd's saved
  tensors, and the storages that die with the graph), equal ``estimate.activations`` for every
  row of the manual's table in docs/parallelism.md (fp32 values and CPU dropout masks, e = m = 4;
  LayerNorm statistics added where a graph exists);
* Pa with SP has nothing to partition: it says so and keeps the checkpoints as they are.
"""

import warnings

import pytest
import torch

from tests.harness import spawn
from tests.parity import assert_bitwise
from zerotron.activation import ActivationCheckpointConfig, apply_activation_checkpointing
from zerotron.model import GPT, GPTConfig
from zerotron.parallel import Grid, ParallelDims

SHAPE = dict(num_layers=2, hidden_size=64, num_heads=4, vocab_size=128, seq_length=32,
             make_vocab_size_divisible_by=8, dropout=0.1, attention_dropout=0.1)


def _run(grid, sp, batch, **ac):
    import zerotron.model.block as block

    model = GPT(GPTConfig(**SHAPE), grid, seed=5, sequence_parallel=sp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = apply_activation_checkpointing(model, grid, ActivationCheckpointConfig(**ac).validate())
    calls, real = [0], block.causal_attention
    block.causal_attention = lambda *a: (calls.__setitem__(0, calls[0] + 1), real(*a))[1]
    try:
        model.rng.seed(11, grid)
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
    finally:
        block.causal_attention = real
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, calls[0], handle, [str(w.message) for w in caught]


def check_bitwise(grid):
    g = torch.Generator().manual_seed(3)
    batch = torch.randint(0, SHAPE["vocab_size"], (2, SHAPE["seq_length"] + 1), generator=g)
    layers = SHAPE["num_layers"]
    for sp in (False, True):
        loss, grads, calls, _, _ = _run(grid, sp, batch)
        assert calls == layers
        variants = {
            "selective": (dict(recompute_granularity="selective"), 2 * layers),
            "full (k=2)": (dict(checkpoint_activations=True, checkpoint_every=2), 2 * layers),
            "full, regathered": (dict(checkpoint_activations=True, sequence_parallel_gather="regather"), 2 * layers),
            "selective in full (k=2)": (dict(recompute_granularity="selective", checkpoint_activations=True,
                                             checkpoint_every=2), 3 * layers),  # forward, recompute, its core again
            "selective + full + Pa + Pa+cpu": (dict(recompute_granularity="selective", checkpoint_activations=True,
                                                    partition_activations=True, cpu_checkpointing=True), 3 * layers),
        }
        for what, (ac, want_calls) in variants.items():
            l2, g2, calls, handle, said = _run(grid, sp, batch, **ac)
            what = f"sp={sp} {what}"
            assert calls == want_calls, f"{what}: attention core ran {calls} times, expected {want_calls}"
            assert_bitwise(l2, loss, f"{what}: loss")
            for name in grads:
                assert_bitwise(g2[name], grads[name], f"{what}: gradient {name}")
            if handle is not None and ac.get("partition_activations"):
                assert handle.store.partition is not sp, what  # SP: the checkpoint is already 1/t
                assert any("nothing left to partition" in m for m in said) is sp, (what, said)


def check_bytes(grid):
    from zerotron.estimate.activations import layer_activation_bytes, layernorm_stats_bytes
    from zerotron.testing.activation_bytes import ROWS, measure_row

    cfg = GPTConfig(**{**SHAPE, "num_layers": 1})  # per layer; the bench measures two
    b, s, h, a, t = 2, cfg.seq_length, cfg.hidden_size, cfg.num_heads, grid.tp_size
    out = {}
    for name, (sp, fields) in ROWS.items():
        got = measure_row(name, cfg, grid, b)
        full = fields.get("checkpoint_activations", False)
        recompute = "full" if full else fields.get("recompute_granularity", "none").replace("full", "none")
        want = layer_activation_bytes(b, s, h, a, t, sp, recompute, act_bytes=4, mask_bytes=4,
                                      partition_activations=fields.get("partition_activations", False))
        if full:  # the checkpoint lives outside autograd: only the allocator sees it
            assert got["saved"] == 0 and got["freed"] == want, (name, got, want)
        else:
            want += layernorm_stats_bytes(b, s, t, sp)
            assert got["saved"] == want, (name, got, want)
            assert got["freed"] >= got["saved"], (name, got)  # a saved view holds its whole storage
        out[name] = got
    return out


def check_all():
    grid = Grid(ParallelDims(tp=2))
    check_bitwise(grid)
    check_bytes(grid)
    return True


def test_selective_recompute_tp2():
    assert all(spawn(check_all, 2, timeout=120))


def test_recompute_granularity_config():
    assert ActivationCheckpointConfig(recompute_granularity="selective").validate()
    with pytest.raises(ValueError, match="activation_checkpointing.recompute_granularity='partial'"):
        ActivationCheckpointConfig(recompute_granularity="partial").validate()
