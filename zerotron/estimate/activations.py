"""Activation bytes one transformer layer keeps for backward: Korthikanti et al. 2022 (arXiv
2205.05198) Table 2, with tensor parallelism, sequence parallelism, selective and full recompute.

Per layer, with s sequence, b micro-batch, h hidden, a heads, t the TP size, f the MLP width
(4h in the paper), e bytes per activation value and m per dropout-mask value (the paper's e = 2,
16-bit, and m = 1, a byte mask), in units of s·b·h:

* **replicated over TP** (outside the TP GEMMs): the two LayerNorm inputs and the two GEMM
  inputs they feed (QKV, fc1), 4e, and the two residual-dropout masks, 2m: 10 in the paper;
* **split by TP**: Q, K, V (3e), the attention-output GEMM's input (e), GeLU's input and fc2's
  input (e·f/h each): 24/t in the paper;
* **attention core**: softmax output, its dropout mask and dropout output, (2e + m)·a·s/h per
  s·b·h, split by TP: 5·a·s/(h·t) in the paper.

So, as Table 2 has it: none ``34 + 5as/h``; TP ``10 + 24/t + 5as/(ht)``; TP + sequence
parallelism ``34/t + 5as/(ht)`` (the replicated part is split along the sequence as well);
selective recompute drops the attention-core term (``10 + 24/t``, ``34/t`` with SP); full
recompute keeps only the layer's input, ``e`` (``2``), split over TP by sequence parallelism or
Pa. A fused attention kernel (flash / memory-efficient, a GPU's SDPA) never stores the
probabilities: the attention-core term is 0 there as with selective recompute.

Where the kernels differ from the paper's accounting the arguments say so instead of a fudge
factor: torch's CPU dropout keeps its mask as the scaled noise in the activation dtype (m = e),
CUDA's fused dropout a byte mask (m = 1). The LayerNorm statistics (mean and 1/σ, fp32, per
token) are below the paper's resolution and are given separately (``layernorm_stats_bytes``).
"""

from __future__ import annotations

RECOMPUTE = ("none", "selective", "full")


def layer_activation_bytes(b: int, s: int, h: int, heads: int, tp: int = 1, sequence_parallel: bool = False,
                           recompute: str = "none", ffn: int | None = None, fused_attention: bool = False,
                           act_bytes: int = 2, mask_bytes: int = 1, partition_activations: bool = False) -> float:
    """Bytes one layer keeps for backward on one TP rank (module docstring; Table 2)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: use one of {RECOMPUTE}")
    e, m, t, f = act_bytes, mask_bytes, tp, 4 * h if ffn is None else ffn
    sbh = s * b * h
    if recompute == "full":  # the checkpoint: the layer's input, 1/t of it with SP or Pa
        return sbh * e / (t if (sequence_parallel or partition_activations) else 1)
    replicated = 4 * e + 2 * m
    split = 4 * e + 2 * e * f / h
    core = 0.0 if (recompute == "selective" or fused_attention) else (2 * e + m) * heads * s / h
    return sbh * ((replicated / t if sequence_parallel else replicated) + split / t + core / t)


def layernorm_stats_bytes(b: int, s: int, tp: int = 1, sequence_parallel: bool = False, norms: int = 2,
                          stat_bytes: int = 4) -> float:
    """Mean and reciprocal σ of each token, per LayerNorm (fp32 in torch's kernels for 16-bit
    inputs): 2·s·b·4 bytes a norm, split along the sequence with SP. Not in Table 2."""
    return norms * 2 * s * b * stat_bytes / (tp if sequence_parallel else 1)


def korthikanti_table2(s: int, b: int, h: int, a: int, t: int) -> dict[str, float]:
    """The paper's Table 2 rows, bytes per layer, written as printed (16-bit values, byte masks)."""
    sbh = s * b * h
    return {
        "none": sbh * (34 + 5 * a * s / h),
        "tp": sbh * (10 + 24 / t + 5 * a * s / (h * t)),
        "tp+sp": sbh * (34 / t + 5 * a * s / (h * t)),
        "tp+selective": sbh * (10 + 24 / t),
        "tp+sp+selective": sbh * 34 / t,
        "full": sbh * 2,
    }



def llama_extra_bytes(cfg, b: int, tp: int = 1, sequence_parallel: bool = False,
                      recompute: str = "none", act_bytes: int = 2, cpu: bool = False,
                      storages: bool = True, ring: bool = False) -> float:
    """What a Llama-family layer (``model/block.py``) keeps beyond ``layer_activation_bytes`` of
    the same shape; 0 for GPT-2's block, whose figures stay the paper's. Per layer, as autograd
    saves it (held to ``testing/activation_bytes.py`` by
    ``tests/estimate/test_llama_activations.py``), per s·b·h unless said:

    * GQA: K and V are kv wide, not h: 2e·(kv/h - 1)/t (negative) -- on a CPU; a GPU's
      memory-efficient kernel (the dry run's) takes one K/V head per query head, so there the
      repeated K and V are saved h wide and nothing is gained;
    * SwiGLU: gate, up and silu(gate) beside fc2's input, 4 f-wide tensors to GeLU's 2:
      2e·f/(h·t) more;
    * RMSNorm: its input at the statistics' width (16-bit values are normalised in fp32) and the
      normalised tensor before the weight, beside the GEMM input: max(e, 4) per norm beyond
      LayerNorm's input;
    * RoPE: each layer's cos and sin tables, s·d each (b·s·d with per-document positions), not
      split by TP or SP (attention sees the whole sequence);
    * ``storages``: what the allocator holds beyond the saved extents -- once q or k is a copy
      (rotated, or regrouped by GQA) and V is saved as a view of the fused QKV output, V keeps
      that whole (h + 2kv)/t-wide storage alive: e·(h + kv)/(h·t) more;
    * document masking on a CPU: SDPA turns the boolean mask into one b·s² additive mask in the
      activation dtype (a GPU's flex block mask is O((s/128)²): left out).

    Under context parallelism (``ring``) the ring saves K and V as they come, kv wide, on any
    device, and builds each block's mask as it goes (``estimate/context_parallel.py``).
    Selective recompute re-runs the core, mask included; full recompute keeps only the checkpoint.
    Per-token statistics are left out as for GPT-2 (``norm_stats_bytes``)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: use one of {RECOMPUTE}")
    if recompute == "full":
        return 0.0
    e, t, s, h, kv = act_bytes, tp, cfg.seq_length, cfg.hidden_size, cfg.kv_size
    repeated = not cpu and not ring and kv != h  # the GPU kernel's K/V, one per query head
    split = 2 * e * ((h if repeated else kv) / h - 1)  # K and V
    split += 2 * e * cfg.ffn_size / h if cfg.gated else 0  # SwiGLU's two more f-wide tensors
    copied_q = cfg.position_embedding_type == "rope" or kv != h
    if storages and copied_q and not repeated:
        split += e * (h + kv) / h  # V's view keeps the fused QKV output
    replicated = 2 * max(e, 4) if cfg.normalization == "RMSNorm" else 0
    extra = s * b * h * (split / t + (replicated / t if sequence_parallel else replicated))
    if cfg.position_embedding_type == "rope":  # cos and sin, made again in every layer
        extra += 2 * s * cfg.head_dim * e * (b if cfg.reset_position_ids else 1)
    if recompute == "none" and cpu and not ring and cfg.reset_attention_mask:
        extra += b * s * s * e
    return extra


def norm_stats_bytes(cfg, b: int, tp: int = 1, sequence_parallel: bool = False,
                     act_bytes: int = 2, recompute: str = "none",
                     fused_attention: bool = True) -> float:
    """The per-token statistics a layer saves, below Table 2's resolution: LayerNorm's two
    (``layernorm_stats_bytes``) or RMSNorm's one rsqrt per norm (fp32, or the value's own width
    above it), and a fused kernel's fp32 log-sum-exp per head and token (not kept by selective)."""
    s, t = cfg.seq_length, tp
    if cfg.normalization == "RMSNorm":
        out = 2 * s * b * max(act_bytes, 4) / (t if sequence_parallel else 1)
    else:
        out = layernorm_stats_bytes(b, s, t, sequence_parallel)
    if recompute == "none" and fused_attention:
        out += 4 * b * s * cfg.num_heads / t
    return out
