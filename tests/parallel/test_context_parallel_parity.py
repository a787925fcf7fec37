"""Context parallelism against the single-sequence model, float64, on 4 gloo ranks.

Layouts: CP 4; CP 2 x TP 2 with sequence parallelism; CP 2 x DP 2; CP 2 x PP 2 (1F1B, and
interleaved with 2 model chunks per rank, two micro-batches) -- GPT-2 and the Llama block
(RoPE with Llama-3.1 scaling, GQA 3:1, SwiGLU, RMSNorm), with document masking whose documents
cross chunk boundaries, with full and selective recompute. Reference: the same model at cp = 1
(same seed, so the same weights: init is layout-independent), run on each rank on the whole
sequence -- the cp = 1 model is itself held to transformers by ``tests/model/test_llama_parity``.
Compared, relative to the reference's largest magnitude, to 1e-10: this rank's chunks of the
logits, and every parameter's gradient summed over the CP group (each rank's loss is its tokens'
share times cp, the gradients averaged over DP x CP as ZeRO does).
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import spawn
from zerotron.model import GPT, GPTConfig
from zerotron.parallel import Grid, ParallelDims
from zerotron.parallel import collectives as C
from zerotron.parallel.context_parallel import local_chunks

EOD, REL_TOL = 2, 1e-10
GPT2 = dict(num_layers=2, hidden_size=48, num_heads=6, vocab_size=97, seq_length=32,
            make_vocab_size_divisible_by=8, eod_token_id=EOD, dropout=0.0, attention_dropout=0.0)
LLAMA = dict(GPT2, num_query_groups=2, ffn_hidden_size=44, position_embedding_type="rope",
             normalization="RMSNorm", activation="swiglu", add_bias_linear=False,
             untie_embeddings_and_output_weights=True, rotary_base=500000.0, rope_scaling=True,
             rope_scaling_factor=8.0, rope_scaling_original_max_position_embeddings=16)
SHAPES = {"gpt2": GPT2, "llama": LLAMA}


def rel_err(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def batch(documents: bool, s: int):
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, 97, (2, s), generator=g)
    labels = torch.randint(0, 97, (2, s), generator=g)
    labels[0, 3] = labels[1, s - 2] = -100  # ignored tokens count in no rank's share
    if documents:  # ends at positions that are no chunk boundary: documents cross them
        ids[0, [5, 13, 22]] = EOD
        ids[1, [9, 26]] = EOD
    return ids, labels


def one_case(shape, cp, tp=1, sp=False, recompute=None, documents=False, pp=1, v=1):
    from zerotron.activation import ActivationCheckpointConfig, apply_activation_checkpointing
    from zerotron.model.stages import build_stage

    layers = dict(num_layers=4) if pp > 1 else {}
    cfg = GPTConfig(**{**SHAPES[shape], **layers}, reset_attention_mask=documents,
                    reset_position_ids=documents)
    ref_grid = Grid(ParallelDims(tp=tp))
    grid = Grid(ParallelDims(tp=tp, cp=cp, pp=pp, virtual_stages=v))
    ref = GPT(cfg, ref_grid, dtype=torch.float64, seed=5, sequence_parallel=sp)
    model = build_stage(cfg, grid, dtype=torch.float64, seed=5, sequence_parallel=sp)
    if pp > 1:
        return pipeline_case(cfg, ref, model, grid, ref_grid)
    if recompute:
        ac = ActivationCheckpointConfig(checkpoint_activations=recompute == "full",
                                        recompute_granularity=recompute)
        apply_activation_checkpointing(model, grid, ac)
    ids, labels = batch(documents, cfg.seq_length)
    with torch.no_grad():
        want = local_chunks(ref(ids), grid.cp_rank, cp)
        errors = {"logits": rel_err(model(ids), want)}
    ref(ids, labels=labels).backward()
    model(ids, labels=labels).backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g = p.grad.clone()
        C.all_reduce(g, grid.cp_group)
        errors[name] = rel_err(g / cp, ref_grads[name].grad)
    grid.close()
    ref_grid.close()
    return errors


def pipeline_case(cfg, ref, model, grid, ref_grid):
    """Two micro-batches through the pipeline schedule; gradients of this stage's parameters."""
    from zerotron.model.stages import pipeline_step

    ids, labels = batch(False, cfg.seq_length)
    mbs = [(ids[:1], labels[:1]), (ids[1:], labels[1:])]
    pipeline_step(model, mbs if grid.is_first_stage or grid.is_last_stage else [(None, None)] * 2,
                  micro_batch_size=1)
    (sum(ref(x, labels=y) for x, y in mbs) / 2).backward()
    ref_grads = {ref.global_name(n): p.grad for n, p in ref.named_parameters()}
    errors = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        C.all_reduce(g, grid.cp_group)
        errors[name] = rel_err(g / grid.cp_size, ref_grads[model.global_name(name)])
    grid.close()
    ref_grid.close()
    return errors


CASES = [
    dict(shape="gpt2", cp=4),
    dict(shape="llama", cp=4, documents=True),
    dict(shape="llama", cp=2, tp=2, sp=True, documents=True),
    dict(shape="gpt2", cp=2, tp=2, sp=True, recompute="selective"),
    dict(shape="llama", cp=2, recompute="full"),
    dict(shape="llama", cp=2, recompute="selective", documents=True),
    dict(shape="llama", cp=2, pp=2),
    dict(shape="gpt2", cp=2, pp=2, v=2),
]


def all_cases():
    torch.set_num_threads(1)
    return [one_case(**case) for case in CASES]


def test_logits_and_gradients_equal_cp1_in_float64():
    for rank, per_case in enumerate(spawn(all_cases, 4, timeout=300)):
        for case, errors in zip(CASES, per_case):
            worst = max(errors, key=errors.get)
            off = errors[worst]
            assert off < REL_TOL, f"rank {rank} {case}: {worst} off by {off:.2e}"
