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
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from zerotron.model.config import GPTConfig
from zerotron.parallel import host_sync
from zerotron.parallel.grid import Grid
from zerotron.parallel.rng import TPRNG
from zerotron.parallel.shard_info import ShardInfo, set_shard_info
from zerotron.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

try:  # NVIDIA apex's fused kernel, only when it is importable (never pip-installed: see DEVELOPERS.md)
    from apex.normalization import FusedLayerNorm as _ApexLayerNorm
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _ApexLayerNorm = None


def make_layernorm(hidden: int, eps: float, dtype, device) -> nn.Module:
    """apex's FusedLayerNorm on CUDA when importable, else torch's; params TP-replicated."""
    on_cuda = device is not None and torch.device(device).type == "cuda"
    if _ApexLayerNorm is not None and on_cuda:
        ln = _ApexLayerNorm(hidden, eps=eps).to(device=device, dtype=dtype)
    else:
        ln = nn.LayerNorm(hidden, eps=eps, dtype=dtype, device=device)
    for p in ln.parameters():
        set_shard_info(p, ShardInfo(None, tuple(p.shape)))
    return ln


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
    """

    def __init__(self, cfg: GPTConfig, grid: Grid, rng: TPRNG, dtype, device):
        super().__init__()
        h = cfg.hidden_size
        self.heads_per_rank = cfg.num_heads // grid.tp_size
        self.head_dim = cfg.head_dim
        self.dropout_p = cfg.attention_dropout
        self.rng = rng
        self.qkv = ColumnParallelLinear(h, 3 * h, grid, dtype=dtype, device=device)
        self.proj = RowParallelLinear(h, h, grid, input_is_parallel=True, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, self.heads_per_rank, 3, self.head_dim)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each [b, heads_per_rank, s, head_dim]
        p = self.dropout_p if self.training else 0.0
        region = self.rng.fork() if p > 0 else contextlib.nullcontext()
        with region:  # per-rank stream: each rank's heads get their own dropout masks
            y = causal_attention(q, k, v, p)
        y = y.transpose(1, 2).reshape(b, s, self.heads_per_rank * self.head_dim)
        return self.proj(y)


class ParallelMLP(nn.Module):
    """h → ffn (column-parallel, GeLU locally) → h (row-parallel): Megatron-LM §3's MLP split."""

    def __init__(self, cfg: GPTConfig, grid: Grid, dtype, device):
        super().__init__()
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_size, grid, dtype=dtype, device=device)
        self.fc2 = RowParallelLinear(cfg.ffn_size, cfg.hidden_size, grid, input_is_parallel=True,
                                     dtype=dtype, device=device)
        self.approximate = cfg.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm GPT-2 block; ``layer_id`` is its global index (init seeds, pipeline stages)."""

    def __init__(self, cfg: GPTConfig, grid: Grid, rng: TPRNG, layer_id: int, dtype=torch.float32, device=None):
        super().__init__()
        self.layer_id = layer_id
        self.ln1 = make_layernorm(cfg.hidden_size, cfg.layernorm_eps, dtype, device)
        self.attn = ParallelAttention(cfg, grid, rng, dtype, device)
        self.ln2 = make_layernorm(cfg.hidden_size, cfg.layernorm_eps, dtype, device)
        self.mlp = ParallelMLP(cfg, grid, dtype, device)
        self.dropout = nn.Dropout(cfg.dropout)  # shared stream: acts on replicated activations

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln1(x)))
        return x + self.dropout(self.mlp(self.ln2(x)))

    # names of the residual-branch output projections, scaled by 1/sqrt(2·layers) at init
    residual_projections = ("attn.proj.weight", "mlp.fc2.weight")
