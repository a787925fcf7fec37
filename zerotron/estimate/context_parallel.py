"""Context parallelism (``parallel.cp``) in the memory model: what one CP rank holds.

Ring attention (Megatron-core's p2p context parallelism; Liu et al. 2023, arXiv 2310.01889)
splits every sequence into 2·cp chunks and gives CP rank i chunks i and 2·cp − 1 − i, so a rank
holds s/cp tokens of each of its b sequences. Everything outside attention is per token, so every
activation term of Korthikanti et al. (Table 2) and of the head is the single-rank formula at
sequence s/cp (``local_setup``): activations per rank fall as 1/cp. Parameters are replicated
over CP, and ZeRO partitions the model states over DP × CP (Megatron's data-parallel-with-CP
group): ``Setup.zero_shards`` is the paper's Nd in §5.4's formulas.

Beyond the layer's own activations, attention holds what the ring has in flight. The ring
(``parallel/ring_attention.py``) computes each block of queries against one rank's K/V exactly,
in a compute dtype c (fp32 for 16-bit inputs, float64 for float64): with dense scores on a GPU
and with document masks (``dense_blocks``), by torch's flash kernel for CPU otherwise. With n =
s/cp tokens, a/t heads and g/t query groups of head dim d on a TP rank, in bytes:

* **saved for backward** beyond a fused kernel: the merged output in c, b·(a/t)·n·d·c (its
  log-sum-exp is the fused kernel's, in ``activations.norm_stats_bytes``);
* **the largest block** (dense) is the diagonal one (n queries by n keys; the others are half of it):
  its scores S = b·(a/t)·n²·c, and three of them alive at once -- the scores beside their
  shifted copy and its exponential in forward; the probabilities beside dO·Vᵀ and its
  difference with D in backward (flash-attention's recurrence) -- plus the causal mask, n² bytes;
* **beside it in forward**: q in c (a copy unless c is the input's dtype), the stacked K/V pair
  in c (2·b·(g/t)·n·d·c) and the receive buffer of the next, the running output and
  log-sum-exp, and K/V expanded to every query head when g < a (GQA);
* **beside it in backward**: q and dO in c, D, the dQ accumulator, the K/V pair, its receive
  buffer and the dK/dV accumulator (three pairs), and the expanded K/V.

The forward moment coincides with the kept activations (checkpoints). The backward one comes
after the layer's MLP and output projection have run backward and freed what they saved, so
beside a recomputed layer it meets only the attention side of it (``attention_side_bytes``):
the norm's output the QKV GEMM saved, the QKV output q, k and v are views of (and RoPE's
rotated copies of q and k), and the two gradients in flight (the residual stream's and the
core's output's), each b·n·h·e.
"""

from __future__ import annotations

import dataclasses


def local_setup(setup):
    """``setup`` as one CP rank's activations see it: the model at sequence s/cp (the tokens its
    two chunks hold); the same setup at cp 1. Parameters and the position table are not seq-sized
    by this (``max_position_embeddings`` is pinned to the global sequence)."""
    cp = setup.cp
    if cp == 1:
        return setup
    cfg = setup.model
    model = dataclasses.replace(cfg, seq_length=cfg.seq_length // cp,
                                max_position_embeddings=cfg.max_positions)
    return dataclasses.replace(setup, model=model)


def compute_bytes(act_bytes: int) -> int:
    """The ring's arithmetic dtype: fp32 for 16-bit activations, their own dtype above."""
    return max(act_bytes, 4)


def dense_blocks(setup) -> bool:
    """Whether the ring's blocks materialise their scores: on a GPU (the dry run's) and with
    document masks; a CPU's blocks without them run torch's flash kernel for CPU."""
    return setup.device != "cpu" or setup.model.reset_attention_mask


def _sizes(setup, act_bytes: int) -> dict[str, float]:
    """Bytes of the ring's tensors on one rank (module docstring); ``setup`` is local. A flash
    block holds, instead of three score tensors, three output-sized ones: the block's output
    beside the two weighted terms of the merge (forward), the block's dQ, dK and dV at query-head
    width (backward)."""
    cfg, t, c = setup.model, setup.tp, compute_bytes(act_bytes)
    n, d, heads, groups = cfg.seq_length, cfg.head_dim, cfg.num_heads // t, cfg.query_groups // t
    b = setup.micro_batch
    rows = b * heads * n  # one value per query head and token
    dense = dense_blocks(setup)
    return {"q": rows * d * c, "copy": rows * d * c if c != act_bytes else 0,
            "pair": 2 * b * groups * n * d * c, "lse": rows * c,
            "expanded": 2 * rows * d * c if groups != heads else 0,
            "scores": rows * n * c if dense else rows * d * c, "mask": n * n if dense else 0}


def ring_saved_bytes(setup, act_bytes: int) -> float:
    """Per layer, what the ring saves beyond a fused kernel: its output in the compute dtype."""
    if setup.cp == 1:
        return 0.0
    return _sizes(setup, act_bytes)["q"]


def ring_forward_bytes(setup, act_bytes: int) -> float:
    """Forward's peak inside one layer's ring attention (module docstring)."""
    z = _sizes(setup, act_bytes)
    return (3 * z["scores"] + z["mask"] + z["copy"] + 2 * z["pair"] + z["q"] + z["lse"]
            + z["expanded"])


def ring_backward_bytes(setup, act_bytes: int) -> float:
    """Backward's peak inside one layer's ring attention (module docstring)."""
    z = _sizes(setup, act_bytes)
    return (3 * z["scores"] + z["mask"] + 2 * z["copy"] + z["lse"] + z["q"] + 3 * z["pair"]
            + z["expanded"])


def attention_side_bytes(setup, act_bytes: int) -> float:
    """What a recomputed layer still holds when its ring attention runs backward (module
    docstring); ``setup`` is local."""
    cfg, t, e = setup.model, setup.tp, act_bytes
    tokens = setup.micro_batch * cfg.seq_length
    qkv = tokens * (cfg.hidden_size + 2 * cfg.kv_size) / t * e
    rope = cfg.position_embedding_type == "rope"  # rotated copies of q and k
    rotated = tokens * (cfg.hidden_size + cfg.kv_size) / t * e if rope else 0
    return qkv + rotated + 3 * tokens * cfg.hidden_size * e + ring_saved_bytes(setup, act_bytes)


def ring_working_bytes(setup, act_bytes: int, backward: bool = True) -> float:
    """What ring attention holds at one layer's attention, beyond what the layer saved; 0
    without CP."""
    if setup.cp == 1:
        return 0.0
    if backward:
        return ring_backward_bytes(setup, act_bytes)
    return ring_forward_bytes(setup, act_bytes)
