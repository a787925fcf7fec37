"""Document masking of packed samples (``model.reset_attention_mask`` / ``reset_position_ids``).

Reference: each document of a packed sample run alone through the same model. In float64 the
packed sample's logits at a document's tokens equal that document's own logits to 1e-10
relative (a masked score adds an exact zero), for the Llama block (RoPE, GQA) and for GPT-2's
learned positions, while without masking they differ by far more. TP 2 with sequence
parallelism gives the single process's packed logits (positions looked up per rank's tokens).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.harness import spawn
from zerotron.model import GPT, GPTConfig
from zerotron.model.documents import document_layout
from zerotron.parallel import Grid, ParallelDims

EOD, REL_TOL = 2, 1e-10
GPT2 = dict(num_layers=2, hidden_size=48, num_heads=6, vocab_size=97, seq_length=16,
            make_vocab_size_divisible_by=8, eod_token_id=EOD)
LLAMA = dict(GPT2, num_query_groups=2, ffn_hidden_size=44, position_embedding_type="rope",
             normalization="RMSNorm", activation="swiglu", add_bias_linear=False,
             untie_embeddings_and_output_weights=True)
LENGTHS = (5, 7, 4)  # each document ends with EOD; they fill seq_length


def packed_sample(seed=0):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.cat([torch.randint(3, 97, (n - 1,), generator=g), torch.tensor([EOD])])
            for n in LENGTHS]
    return torch.cat(docs).unsqueeze(0), docs


def rel_err(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def test_document_layout_restarts_after_each_end_token():
    ids = torch.tensor([[5, 6, EOD, 7, 8, EOD, 9], [EOD, 5, 6, 7, 8, 9, 4]])
    doc, pos = document_layout(ids, EOD)
    assert doc.tolist() == [[0, 0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1, 1]]
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2, 0], [0, 0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize("shape", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_packed_logits_equal_each_document_alone_in_float64(shape):
    grid = Grid(ParallelDims(), rank=0, world_size=1)
    masked = GPTConfig(**shape, reset_attention_mask=True, reset_position_ids=True)
    model = GPT(masked, grid, dtype=torch.float64, seed=3)
    unmasked_cfg = dataclasses.replace(masked, reset_attention_mask=False, reset_position_ids=False)
    plain = GPT(unmasked_cfg, grid, dtype=torch.float64, seed=3)
    ids, docs = packed_sample()
    v = masked.vocab_size  # the padded columns hold the lowest value
    with torch.no_grad():
        packed, unmasked = model(ids)[..., :v], plain(ids)[..., :v]
        start = 0
        for doc in docs:
            alone = plain(doc.unsqueeze(0))[..., :v]
            err = rel_err(packed[0, start:start + len(doc)], alone[0])
            assert err <= REL_TOL, f"document at {start}: packed logits off by {err:.3g} relative"
            start += len(doc)
    assert rel_err(unmasked, packed) > 1e-3  # the masking is what makes them equal


def _tp2_sp(shape):
    grid = Grid(ParallelDims(tp=2))
    cfg = GPTConfig(**shape, reset_attention_mask=True, reset_position_ids=True)
    ids, _ = packed_sample()
    one = Grid(ParallelDims(), rank=0, world_size=1)
    ref = GPT(cfg, one, dtype=torch.float64, seed=3)(ids).detach()
    local = GPT(cfg, grid, dtype=torch.float64, seed=3, sequence_parallel=True)(ids).detach()
    parts = [torch.empty_like(local) for _ in range(2)]
    torch.distributed.all_gather(parts, local.contiguous(), group=grid.tp_group.pg)
    full = torch.cat(parts, dim=-1)[..., :cfg.vocab_size]
    return rel_err(full, ref[..., :cfg.vocab_size])


def test_tp2_sequence_parallel_packed_logits_equal_the_single_process():
    for shape in (LLAMA, GPT2):
        errs = spawn(_tp2_sp, 2, shape, timeout=120)
        assert max(errs) <= REL_TOL, errs
