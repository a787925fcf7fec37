"""One GPT-2 transformer block, tensor-parallel the Megatron-LM way (§3, Fig. 3).

    x = x + dropout(proj(attention(qkv(ln1(x)))))     # qkv column-, proj row-parallel
    x = x + dropout(fc2(gelu(fc1(ln2(x)))))            # fc1 column-, fc2 row-parallel

Each TP rank holds num_heads/tp whole heads, so attention itself needs no communication; the
only collectives are f before each column-parallel GEMM (all-reduce backward) and g after each
row-parallel GEMM (all-reduce forward): exactly 2 all-reduces forward and 2 backward per block.

The fused QKV weight is laid out head-major, rows ordered (head, {q, k, v}, head_dim) as in
Megatron-LM, so a contiguous split along dim 0 gives each rank whole heads with their q, k, v.

Dropout placement (Megatron-LM App. B.2): attention-probability dropout is inside the TP region
and draws from the per-rank stream (``rng.fork()``); residual dropout acts on the all-reduced,
replicated output and draws from the shared default stream, identical on every TP rank.

With sequence parallelism (Korthikanti et al. 2022 §4.2.2, ``parallel.sequence_parallel``) the
block takes and returns this rank's s/t of a sequence-first [s/t, b, h]: LayerNorms, residual
dropout and the residual adds act on it; qkv and fc1 all-gather their input, proj and fc2
reduce-scatter their output (``parallel.sequence_parallel``), so f/g's all-reduces become an
all-gather and a reduce-scatter each, the same bytes. Residual dropout then draws per rank
(``rng.fork("sp")``: each rank holds different tokens); attention dropout is unchanged.

The attention core (QKᵀ, softmax, dropout, ·V) is one method, ``ParallelAttention.core``, so
selective recompute (``activation.selective``, Korthikanti §5) can re-run just it in backward.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from zerotron.model.config import GPTConfig
from zerotron.model.layernorm import make_layernorm
from zerotron.parallel import host_sync
from zerotron.parallel.grid import Grid
from zerotron.parallel.rng import TPRNG
from zerotron.parallel.sequence_parallel import sequence_parallel_norm
from zerotron.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear



def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """``scaled_dot_product_attention``, causal. A GPU runs it as a fused kernel (flash on sm80+,
    memory-efficient on V100) that keeps O(s) state per head for backward, where the CPU's math
    kernel keeps the b·a·s² probabilities. A dry run's fake accelerator has no such dispatch, so
    there the memory-efficient kernel is called by name: the dry run then holds what the GPU would."""
    if host_sync.simulated() and q.device.type != "cpu":
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, dropout_p, True)[0]
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


class ParallelAttention(nn.Module):
    """Causal self-attention over this rank's heads via ``scaled_dot_product_attention``.

    SDPA dispatches to flash / memory-efficient kernels on GPU and to the math kernel on CPU.
    Input and output are [b, s, h], or sequence-first [s/t, b, h] with ``sequence_parallel``.
    """

    def __init__(self, cfg: GPTConfig, grid: Grid, rng: TPRNG, dtype, device, sequence_parallel: bool = False):
        super().__init__()
        h = cfg.hidden_size
        self.heads_per_rank = cfg.num_heads // grid.tp_size
        self.head_dim = cfg.head_dim
        self.dropout_p = cfg.attention_dropout
        self.rng = rng
        self.seq_first = sequence_parallel
        self.qkv = ColumnParallelLinear(h, 3 * h, grid, dtype=dtype, device=device, sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(h, h, grid, input_is_parallel=True, dtype=dtype, device=device,
                                      sequence_parallel=sequence_parallel)
        # Replaces the direct call of ``core`` when set (selective recompute:
        # zerotron.activation.selective); called as core_runner(core, q, k, v).
        self.core_runner = None

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """QKᵀ, softmax, dropout, ·V over this rank's heads ([b, heads_per_rank, s, head_dim])."""
        p = self.dropout_p if self.training else 0.0
        region = self.rng.fork() if p > 0 else contextlib.nullcontext()
        with region:  # per-rank stream: each rank's heads get their own dropout masks
            return causal_attention(q, k, v, p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [b, s, 3h/t], or [s, b, 3h/t] gathered from the sequence pieces
        heads, d = self.heads_per_rank, self.head_dim
        if self.seq_first:
            s, b = qkv.shape[:2]
            q, k, v = qkv.view(s, b, heads, 3, d).permute(3, 1, 2, 0, 4).unbind(0)
        else:
            b, s = qkv.shape[:2]
            q, k, v = qkv.view(b, s, heads, 3, d).permute(3, 0, 2, 1, 4).unbind(0)
        # each [b, heads_per_rank, s, head_dim]
        y = self.core(q, k, v) if self.core_runner is None else self.core_runner(self.core, q, k, v)
        if self.seq_first:
            y = y.permute(2, 0, 1, 3).reshape(s, b, heads * d)
        else:
            y = y.transpose(1, 2).reshape(b, s, heads * d)
        return self.proj(y)


class ParallelMLP(nn.Module):
    """h → ffn (column-parallel, GeLU locally) → h (row-parallel): Megatron-LM §3's MLP split."""

    def __init__(self, cfg: GPTConfig, grid: Grid, dtype, device, sequence_parallel: bool = False):
        super().__init__()
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_size, grid, dtype=dtype, device=device,
                                        sequence_parallel=sequence_parallel)
        self.fc2 = RowParallelLinear(cfg.ffn_size, cfg.hidden_size, grid, input_is_parallel=True,
                                     dtype=dtype, device=device, sequence_parallel=sequence_parallel)
        self.approximate = cfg.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm GPT-2 block; ``layer_id`` is its global index (init seeds, pipeline stages)."""

    def __init__(self, cfg: GPTConfig, grid: Grid, rng: TPRNG, layer_id: int, dtype=torch.float32, device=None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.layer_id = layer_id
        self.sequence_parallel, self.group, self.rng = sequence_parallel, grid.tp_group, rng
        self.ln1 = make_layernorm(cfg.hidden_size, cfg.layernorm_eps, dtype, device)
        self.attn = ParallelAttention(cfg, grid, rng, dtype, device, sequence_parallel)
        self.ln2 = make_layernorm(cfg.hidden_size, cfg.layernorm_eps, dtype, device)
        self.mlp = ParallelMLP(cfg, grid, dtype, device, sequence_parallel)
        self.dropout = nn.Dropout(cfg.dropout)  # shared stream on replicated activations; per rank with SP

    def _norm(self, ln: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return sequence_parallel_norm(ln, x, self.group) if self.sequence_parallel else ln(x)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.sequence_parallel and self.training and self.dropout.p > 0):
            return self.dropout(x)
        with self.rng.fork("sp"):  # this rank's tokens: its own mask
            return self.dropout(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._dropout(self.attn(self._norm(self.ln1, x)))
        return x + self._dropout(self.mlp(self._norm(self.ln2, x)))

    # names of the residual-branch output projections, scaled by 1/sqrt(2·layers) at init
    residual_projections = ("attn.proj.weight", "mlp.fc2.weight")
