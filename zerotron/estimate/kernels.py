"""One transformer layer's kernels on one TP rank, each timed by a roofline.

A GEMM of m×k by k×n does 2·m·n·k FLOPs and must move at least (m·k + k·n + m·n) elements
through HBM; it takes the longer of FLOPs ÷ (peak × ``gemm_efficiency``) and bytes ÷ HBM
bandwidth, so a thin GEMM (small k, or attention's per-head s×d×s products on a V100) is
bandwidth-bound. The compute side counts whole output tiles in whole waves
(``wave_quantization``): a GEMM whose tiles do not fill the last wave of SMs pays for it.
Backward runs two GEMMs per forward GEMM (the input gradient m×n by n×k and
the weight gradient k×m by m×n), the same FLOPs each, different shapes.

Element-wise and normalisation kernels do few FLOPs per byte, so they are timed by the bytes
they read and write over HBM (``layer_elementwise_elements``). Their backward reads and writes
about twice what the forward does (the saved input and the arriving gradient in, the gradient
out); the model takes exactly 2×.

``layer_gemms`` is the one place a layer's GEMM shapes live: grouped-query attention narrows
``kv_width``, and a SwiGLU MLP is one more column-parallel GEMM (gate) beside fc1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zerotron.model.config import GPTConfig

# element passes over one attention score (per sequence, per head, s² of them) in forward:
# the kernels of the stack each ``Hardware.attention`` stands for (QKᵀ's write and ·V's read are
# the GEMMs' own bytes)
SCORE_PASSES = {
    "unfused": 10,  # 2019 Megatron-LM: scale, mask mul, mask sub, softmax, dropout (r+w each)
    "math": 4,  # fused scale-mask-softmax (r+w), dropout (r+w); its 1-byte mask is added apart
    "flash": 0,  # the scores never leave on-chip memory
}


@dataclass(frozen=True)
class Gemm:
    """``batch`` GEMMs of (m×k)·(k×n)."""

    name: str
    m: int
    n: int
    k: int
    batch: int = 1

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.n * self.k

    def bytes(self, elem: int) -> float:
        """The least HBM traffic: both operands read once, the product written once."""
        return float(elem * self.batch * (self.m * self.k + self.k * self.n + self.m * self.n))

    def backward(self) -> list["Gemm"]:
        """The input gradient (m×n)·(n×k) and the weight gradient (k×m)·(m×n)."""
        return [Gemm(self.name + ".dgrad", self.m, self.k, self.n, self.batch),  # dX = dY·Wᵀ
                Gemm(self.name + ".wgrad", self.k, self.n, self.m, self.batch)]


# the output tile of the cuBLAS tensor-core kernels that run large 16-bit GEMMs, on Volta
# (volta_h884gemm_256x128_*) as on Hopper (sm90_*_128x256x64_*): one tile per SM at a time
GEMM_TILE = (256, 128)


def wave_quantization(g: Gemm, sm_count: int, tile: tuple[int, int] = GEMM_TILE) -> float:
    """How much longer than its FLOPs say a GEMM runs for computing in whole tiles and waves.

    A GEMM's output is cut into tiles, one thread block each, and the SMs take them a wave at
    a time (NVIDIA, *Matrix Multiplication Background User's Guide*, §3: tile and wave
    quantization). The GEMM takes as long as ⌈tiles ÷ SMs⌉ full waves of full tiles, however
    little of the last tile and the last wave is its own: the attention output projection of
    a 1536-wide model at batch 1 on a V100 (1024 × 1536: 4 × 12 = 48 tiles on 80 SMs) runs on
    48 of the SMs. The tile is taken in whichever orientation wastes less, as cuBLAS offers
    both. ``sm_count`` is the datasheet's
    (V100 80, H100 SXM 132); 0 turns the term off. Returns padded work ÷ the GEMM's own (≥ 1)."""
    if sm_count <= 0:
        return 1.0
    own = g.batch * g.m * g.n

    def padded(tm: int, tn: int) -> float:
        tiles = g.batch * math.ceil(g.m / tm) * math.ceil(g.n / tn)
        return math.ceil(tiles / sm_count) * sm_count * tm * tn / own

    return min(padded(*tile), padded(*reversed(tile)))


def gemm_seconds(g: Gemm, peak_flops: float, efficiency: float, hbm_bytes_s: float,
                 elem: int, sm_count: int = 0) -> float:
    """The roofline: compute-bound at ``efficiency`` of peak, in whole waves of tiles
    (``wave_quantization``, off with ``sm_count`` 0), or bandwidth-bound, the slower."""
    compute = g.flops * wave_quantization(g, sm_count) / (peak_flops * efficiency)
    return max(compute, g.bytes(elem) / hbm_bytes_s)


def layer_gemms(cfg: GPTConfig, tokens: int, tp: int) -> list[Gemm]:
    """The weight GEMMs of one layer's forward on one TP rank (Megatron-LM §3 splits).

    QKV and fc1 are column-parallel (n split), the attention output projection and fc2
    row-parallel (k split)."""
    h, f = cfg.hidden_size, cfg.ffn_size
    fc1 = 2 * f if cfg.gated else f  # SwiGLU: gate and up rows in one column-parallel GEMM
    return [Gemm("qkv", tokens, (h + 2 * cfg.kv_size) // tp, h),  # GQA: K and V of the groups
            Gemm("proj", tokens, h, h // tp),
            Gemm("fc1", tokens, fc1 // tp, h),
            Gemm("fc2", tokens, h, f // tp)]


def attention_gemms(cfg: GPTConfig, batch: int, seq: int, tp: int) -> list[Gemm]:
    """QKᵀ and probabilities·V, one per sequence and head of this rank (full s×s)."""
    heads = cfg.num_heads // tp
    d = cfg.hidden_size // cfg.num_heads
    return [Gemm("scores", seq, seq, d, batch * heads), Gemm("context", seq, d, seq, batch * heads)]


def layer_elementwise_elements(cfg: GPTConfig, tokens: int, tp: int,
                               sequence_parallel: bool = False) -> float:
    """Elements one layer's forward reads plus writes outside GEMMs and the attention scores.

    Per token: LayerNorm 1 and 2 (read h, write h: 2h each), each residual dropout (read h,
    write h: 2h, twice) and residual add (read 2h, write h: 3h, twice), GeLU (read and write
    f/t; SwiGLU reads 2f/t and writes f/t) = 14h + 2f/t; with biases, the two row-parallel
    GEMMs' bias adds, which cannot ride in the GEMM because the bias is added once, after the
    partial sums are all-reduced (read h, write h: 2h, twice; Megatron-LM's RowParallelLinear,
    ours in ``parallel.tensor_parallel``), for 18h. The column-parallel biases ride in their
    GEMM (addmm). Sequence parallelism gives each TP rank s/t of the tokens for the h terms,
    which no TP degree otherwise splits. Dropout masks (1 byte per element) are
    ``dropout_mask_bytes``."""
    h, f = cfg.hidden_size, cfg.ffn_size
    replicated = tokens // tp if sequence_parallel else tokens
    per_token = 14 * h + (4 * h if cfg.add_bias_linear else 0)  # + the row-parallel bias adds
    act = 3 * f if cfg.gated else 2 * f  # SwiGLU reads gate and up, writes their product
    return float(replicated * per_token + tokens * act // tp)


def dropout_mask_bytes(cfg: GPTConfig, tokens: int) -> float:
    """The two residual dropouts' 1-byte masks, written in forward (read back in backward);
    ``tokens`` as this rank holds them (s/t under sequence parallelism)."""
    return float(2 * tokens * cfg.hidden_size) if cfg.dropout > 0 else 0.0


def score_elements(cfg: GPTConfig, batch: int, seq: int, tp: int) -> float:
    """Attention scores of this rank's heads: batch · heads/t · s²."""
    return float(batch * (cfg.num_heads // tp) * seq * seq)


def attention_core_seconds(cfg: GPTConfig, batch: int, seq: int, tp: int, kernel: str,
                           peak_flops: float, efficiency: float, hbm_bytes_s: float,
                           elem: int, sm_count: int = 0) -> float:
    """Forward time of the attention core (QKᵀ, softmax, dropout, ·V) by its kernel.

    ``flash`` keeps the scores on chip: FLOPs only, half of them skipped by the causal mask.
    ``math`` and ``unfused`` run the two batched GEMMs by the roofline and stream the s² scores
    through HBM ``SCORE_PASSES`` times (plus a 1-byte dropout mask)."""
    gemms = attention_gemms(cfg, batch, seq, tp)
    if kernel == "flash":
        return sum(g.flops for g in gemms) / 2 / (peak_flops * efficiency)
    if kernel not in SCORE_PASSES:
        raise ValueError(f"attention kernel {kernel!r}: use one of {sorted(SCORE_PASSES)}")
    scores = score_elements(cfg, batch, seq, tp)
    mask = scores if cfg.attention_dropout > 0 else 0.0
    streamed = (scores * SCORE_PASSES[kernel] * elem + mask) / hbm_bytes_s
    return sum(gemm_seconds(g, peak_flops, efficiency, hbm_bytes_s, elem, sm_count)
               for g in gemms) + streamed
