"""Context parallelism (``parallel.cp``) in the memory model: what one CP rank holds.

Ring attention (Megatron-core's p2p context parallelism; Liu et al. 2023, arXiv 2310.01889)
splits every sequence into 2·cp chunks and gives CP rank i chunks i and 2·cp − 1 − i, so a rank
holds s/cp tokens of each of its b sequences. Everything outside attention is per token, so every
activation term of Korthikanti et al. (Table 2) and of the head is the single-rank formula at
sequence s/cp (``local_setup``): activations per rank fall as 1/cp. Parameters are replicated
over CP, and ZeRO partitions the model states over DP × CP (Megatron's data-parallel-with-CP
group): ``Setup.zero_shards`` is the paper's Nd in §5.4's formulas.

Beyond the layer's own activations, attention holds what the ring has in flight
(``ring_working_bytes``); n = b·s/cp tokens, K/V width kv/t per TP rank (kv = query groups × head
dim, GQA), e bytes per activation value:

* **forward**: the K/V pair being attended to and the pair arriving beside it (double
  buffering, so the transfer overlaps the current step's attention), 2 · 2·n·kv/t·e, and the
  running merge of the partial outputs: the fp32 accumulated output n·h/t·4 with its fp32
  log-sum-exp n·a/t·4, plus one step's partial output n·h/t·e and LSE n·a/t·4;
* **backward**: the same two K/V buffers, the dK/dV pair travelling with them and the one
  arriving (fp32 accumulators: 2 · 2·n·kv/t·4), and the fp32 dQ accumulator n·h/t·4.

The larger of the two coincides with one layer's attention: beside a recomputed layer in
backward (full recompute) or beside the kept activations (none).
"""

from __future__ import annotations

import dataclasses


def local_setup(setup):
    """``setup`` as one CP rank's activations see it: the model at sequence s/cp (the tokens its
    two chunks hold); the same setup at cp 1. Parameters and the position table are not seq-sized
    by this (``max_position_embeddings`` is pinned to the global sequence)."""
    cp = getattr(setup, "cp", 1)
    if cp == 1:
        return setup
    cfg = setup.model
    model = dataclasses.replace(cfg, seq_length=cfg.seq_length // cp,
                                max_position_embeddings=cfg.max_positions)
    return dataclasses.replace(setup, model=model)


def ring_forward_bytes(setup, act_bytes: int) -> float:
    """Forward's ring buffers and partial-output merge (module docstring); ``setup`` local."""
    cfg, t, e = setup.model, setup.tp, act_bytes
    n = setup.micro_batch * cfg.seq_length
    kv = 2 * n * cfg.kv_size / t * e  # one K/V pair
    merge = n * cfg.hidden_size / t * (4 + e) + 2 * n * cfg.num_heads / t * 4
    return 2 * kv + merge


def ring_backward_bytes(setup, act_bytes: int) -> float:
    """Backward's K/V and dK/dV buffers and the dQ accumulator (module docstring)."""
    cfg, t, e = setup.model, setup.tp, act_bytes
    n = setup.micro_batch * cfg.seq_length
    kv, dkv = 2 * n * cfg.kv_size / t * e, 2 * n * cfg.kv_size / t * 4
    return 2 * kv + 2 * dkv + n * cfg.hidden_size / t * 4


def ring_working_bytes(setup, act_bytes: int, backward: bool = True) -> float:
    """What ring attention holds in flight at one layer's attention, 0 without CP."""
    if getattr(setup, "cp", 1) == 1:
        return 0.0
    if backward:
        return ring_backward_bytes(setup, act_bytes)
    return ring_forward_bytes(setup, act_bytes)
