"""The GPT on one process (tp=1 grid, no torch.distributed): init, metadata, pipeline pieces, dtypes.

References: F.cross_entropy on the model's own full logits; a whole model built with the same
seed (for pipeline stages built from ``layer_ids``/``pre_process``/``post_process``); the GPT-2
init statistics (N(0, 0.02), residual projections 0.02/sqrt(2·layers)).

Parity tiers (``tests/parity.py``): the model's loss against F.cross_entropy on its logits in
float64 (to ``FP64_TP_PP``) and in fp32 (within twice torch fp32's own error against the float64
loss of the same logits); pipeline pieces against the whole model bitwise (the same kernels on
the same tensors, only split across modules). bf16/fp16 are only checked to run, stay finite
and land near the fp32 loss.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from tests.parity import FP64_TP_PP, assert_bitwise, assert_fp32, assert_fp64
from zerotron.model import GPT, GPTConfig, get_preset
from zerotron.parallel import Grid, ParallelDims
from zerotron.parallel.shard_info import shard_info


@pytest.fixture(scope="module")
def grid():
    return Grid(ParallelDims(), rank=0, world_size=1)


def small(**kw):
    base = dict(num_layers=4, hidden_size=32, num_heads=4, vocab_size=100, seq_length=16,
                make_vocab_size_divisible_by=64)
    base.update(kw)
    return GPTConfig(**base)


def batch(cfg, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg.vocab_size, (b, cfg.seq_length), generator=g),
            torch.randint(0, cfg.vocab_size, (b, cfg.seq_length), generator=g))


def test_tiny_runs_without_collectives_and_counts_params(grid):
    cfg = get_preset("tiny")
    model = GPT(cfg, grid)
    ids, labels = batch(cfg, seed=1)
    loss = model(ids, labels)
    loss.backward()
    assert loss.dtype == torch.float32 and loss.ndim == 0 and math.isfinite(loss.item())
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.5  # near-uniform predictions at init
    assert grid.stats.snapshot() == {}  # tp=1: no collective at all
    assert sum(p.numel() for p in model.parameters()) == cfg.exact_num_params()
    assert all(p.grad is not None for p in model.parameters())


def test_param_metadata_and_init_statistics(grid):
    cfg = small(num_layers=2, hidden_size=64)
    model = GPT(cfg, grid, seed=3)
    for name, p in model.named_parameters():
        info = shard_info(p, name)  # raises if a parameter was made without one
        assert info.global_shape == tuple(p.shape) and not info.embedding_copy, name  # tp=1: local is global
        if "ln" in name:
            assert info.tp_split_dim is None
            assert torch.all(p == (1.0 if name.endswith("weight") else 0.0)), name
        elif p.ndim == 1:
            assert not p.any(), name
    w = model.blocks[0].mlp.fc1.weight
    proj = torch.cat([model.blocks[i].mlp.fc2.weight.flatten() for i in range(2)])
    assert abs(w.std().item() - 0.02) < 0.002
    assert abs(proj.std().item() - 0.02 / math.sqrt(2 * cfg.num_layers)) < 0.001
    word = model.embedding.word.weight
    assert word.shape[0] == 128 and not word[cfg.vocab_size:].any()  # padding rows are zero
    same = GPT(cfg, grid, seed=3)
    other = GPT(cfg, grid, seed=4)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), same.parameters()))
    assert not torch.equal(model.blocks[0].attn.qkv.weight, other.blocks[0].attn.qkv.weight)


def test_loss_matches_cross_entropy_on_logits_and_padding_masked(grid):
    cfg = small()
    ids, labels = batch(cfg)
    labels[0, :5] = -100

    def torch_loss(logits):
        return F.cross_entropy(logits[..., : cfg.vocab_size].reshape(-1, cfg.vocab_size), labels.reshape(-1))

    for dtype in (torch.float64, torch.float32):
        model = GPT(cfg, grid, dtype=dtype)
        with torch.no_grad():
            logits = model(ids)
            loss = model(ids, labels)
        assert logits.shape == (2, cfg.seq_length, 128) and loss.dtype == dtype
        assert (logits[..., cfg.vocab_size:] == torch.finfo(dtype).min).all()
        if dtype == torch.float64:
            assert_fp64(loss, torch_loss(logits), FP64_TP_PP, "float64 loss vs F.cross_entropy")
        else:  # truth: the float64 loss of these very fp32 logits
            assert_fp32(loss, torch_loss(logits.double()), torch_loss(logits), "fp32 loss vs F.cross_entropy")
    per_token = model.head(model.blocks[1](model.blocks[0](model.embed(ids))), labels)
    assert per_token.shape == labels.shape


def test_pipeline_pieces_equal_the_whole_model(grid):
    """Two stages chained equal the whole model bitwise: loss and every gradient (the tied word
    embedding's as the sum of its two copies' gradients, one addition either way)."""
    cfg = small()
    whole = GPT(cfg, grid, seed=9)
    first = GPT(cfg, grid, seed=9, post_process=False, layer_ids=[0, 1])
    last = GPT(cfg, grid, seed=9, pre_process=False, layer_ids=[2, 3])
    copy_info = shard_info(last.word_embedding_copy)
    assert copy_info.embedding_copy and copy_info.tp_split_dim == 0
    assert not shard_info(first.embedding.word.weight).embedding_copy
    assert_bitwise(last.word_embedding_copy.detach(), whole.embedding.word.weight.detach(), "embedding copy")
    assert torch.equal(first.blocks[1].mlp.fc1.weight, whole.blocks[1].mlp.fc1.weight)
    assert torch.equal(last.blocks[0].attn.qkv.weight, whole.blocks[2].attn.qkv.weight)
    assert first.final_ln is None and last.embedding is None
    ids, labels = batch(cfg)
    piecewise, full = last(first(ids), labels), whole(ids, labels)
    assert_bitwise(piecewise, full, "loss")
    piecewise.backward()
    full.backward()
    grads = {n: p.grad for n, p in whole.named_parameters()}
    for stage in (first, last):
        for name, p in stage.named_parameters():
            if stage.global_name(name) == "embedding.word.weight":
                continue
            assert_bitwise(p.grad, grads[stage.global_name(name).replace("layers.", "blocks.")], name)
    tied = first.embedding.word.weight.grad + last.word_embedding_copy.grad
    assert_bitwise(tied, grads["embedding.word.weight"], "tied word embedding grad")
    with pytest.raises(RuntimeError, match="pre_process=False"):
        last.embed(ids)
    with pytest.raises(ValueError, match="layer_ids"):
        GPT(cfg, grid, layer_ids=[4])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_dtypes(grid, dtype):
    cfg = small(num_layers=2)
    model = GPT(cfg, grid, dtype=dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    ids, labels = batch(cfg)
    loss = model(ids, labels)
    assert loss.dtype == torch.float32 and math.isfinite(loss.item())
    loss.backward()
    assert all(p.grad.dtype == dtype and torch.isfinite(p.grad).all() for p in model.parameters())
    ref = GPT(cfg, grid)(ids, labels)  # same seed, fp32
    assert abs(loss.item() - ref.item()) < 0.05


def test_construction_and_input_errors(grid):
    with pytest.raises(ValueError, match="model.hidden_size=30 is not divisible by model.num_heads=4"):
        GPT(small(hidden_size=30), grid)
    with pytest.raises(ValueError, match="dtype"):
        GPT(small(), grid, dtype=torch.int64)
    model = GPT(small(), grid)
    with pytest.raises(ValueError, match="exceeds the position table"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_dropout_reproducible_single_process(grid):
    cfg = small(dropout=0.2, attention_dropout=0.2)
    model = GPT(cfg, grid, seed=5)
    ids, labels = batch(cfg)
    model.rng.seed(1, grid)
    a = model(ids, labels)
    states = model.rng.get_states()
    b = model(ids, labels)
    model.rng.set_states(states)
    c = model(ids, labels)  # replayed streams: what activation recompute relies on
    assert a.item() != b.item() and b.item() == c.item()
