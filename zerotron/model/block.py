"""One transformer block, tensor-parallel the Megatron-LM way (§3, Fig. 3).

    x = x + dropout(proj(attention(qkv(ln1(x)))))     # qkv column-, proj row-parallel
    x = x + dropout(fc2(gelu(fc1(ln2(x)))))            # fc1 column-, fc2 row-parallel

GPT-2's by default; the Llama family's with the architecture fields (``GPTConfig``): RMSNorm for
ln1/ln2, grouped-query attention with RoPE on q and k, SwiGLU in place of GeLU, no biases.

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
from zerotron.model.documents import document_attention
from zerotron.model.layernorm import make_norm
from zerotron.model.rope import FrequencyCache, rotary_tables, rotate
from zerotron.parallel import host_sync
from zerotron.parallel.grid import Grid
from zerotron.parallel.ring_attention import RingContext, ring_attention
from zerotron.parallel.rng import TPRNG
from zerotron.parallel.sequence_parallel import sequence_parallel_norm
from zerotron.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear



def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """``scaled_dot_product_attention``, causal. A GPU runs it as a fused kernel (flash on sm80+,
    memory-efficient on V100) that keeps O(s) state per head for backward, where the CPU's math
    kernel keeps the b·a·s² probabilities. A dry run's fake accelerator has no such dispatch, so
    there the memory-efficient kernel is called by name: the dry run then holds what the GPU would.
    Fewer K/V heads than query heads (grouped-query attention): each serves its group's queries."""
    gqa = k.shape[1] != q.shape[1]
    if host_sync.simulated() and q.device.type != "cpu":
        if gqa:  # the named kernel takes one K/V head per query head
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, dropout_p, True)[0]
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                          enable_gqa=gqa)


class ParallelAttention(nn.Module):
    """Causal self-attention over this rank's heads via ``scaled_dot_product_attention``.

    SDPA dispatches to flash / memory-efficient kernels on GPU and to the math kernel on CPU.
    Input and output are [b, s, h], or sequence-first [s/t, b, h] with ``sequence_parallel``.

    Grouped-query attention (Ainslie et al. 2023): the fused QKV rows are ordered (query group,
    {the group's query heads, k, v}, head_dim) as Megatron-core lays them out, so a contiguous TP
    split gives each rank whole groups; with one query head per group this is GPT-2's
    (head, {q, k, v}, head_dim). ``qk_layernorm`` normalises each head's q and k (its weight's
    gradient summed over TP, whose ranks hold different heads); RoPE then rotates them.
    """

    def __init__(self, cfg: GPTConfig, grid: Grid, rng: TPRNG, dtype, device, sequence_parallel: bool = False):
        super().__init__()
        h = cfg.hidden_size
        self.cfg, self.group = cfg, grid.tp_group
        self.groups_per_rank = cfg.query_groups // grid.tp_size
        self.heads_per_group = cfg.num_heads // cfg.query_groups
        self.heads_per_rank = cfg.num_heads // grid.tp_size
        self.head_dim = cfg.head_dim
        self.dropout_p = cfg.attention_dropout
        self.rng = rng
        self.seq_first = sequence_parallel
        sp = sequence_parallel
        self.qkv = ColumnParallelLinear(h, h + 2 * cfg.kv_size, grid, bias=cfg.qkv_bias,
                                        dtype=dtype, device=device, sequence_parallel=sp)
        self.proj = RowParallelLinear(h, h, grid, bias=cfg.add_bias_linear, input_is_parallel=True,
                                      dtype=dtype, device=device, sequence_parallel=sp)
        self.inv_freq = FrequencyCache(cfg)  # RoPE's frequencies, made once per device
        if cfg.qk_layernorm:
            d, eps = cfg.head_dim, cfg.layernorm_eps
            self.q_norm = make_norm(cfg.normalization, d, eps, dtype, device)
            self.k_norm = make_norm(cfg.normalization, d, eps, dtype, device)
        # Replaces the direct call of ``core`` when set (selective recompute:
        # zerotron.activation.selective); called as core_runner(core, q, k, v).
        self.core_runner = None
        # While a packed batch runs (model.documents): each token's position inside its document
        # and its document's index, [b, s] (None: positions 0..s-1, one document). With context
        # parallelism positions are those of this rank's tokens, documents the whole sequence's.
        self.positions = self.documents = None
        # context parallelism: this rank's place in the CP ring (parallel.ring_attention)
        self.ring = RingContext(grid.cp_group, grid.cp_rank, grid.cp_size) if grid.cp_size > 1 else None

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """QKᵀ, softmax, dropout, ·V over this rank's heads ([b, heads, s, head_dim]; k, v:
        [b, groups, s, head_dim])."""
        p = self.dropout_p if self.training else 0.0
        region = self.rng.fork() if p > 0 else contextlib.nullcontext()
        # a dry run's fake GPU runs the fused causal kernel: O(s) per head, what flex would hold
        fake_gpu = host_sync.simulated() and q.device.type != "cpu"
        if self.ring is not None:  # the rest of the sequence's K/V come around the CP ring
            return ring_attention(q, k, v, self.ring, self.documents)
        if self.documents is not None and not fake_gpu:
            return document_attention(q, k, v, self.documents)  # no dropout: refused at start-up
        with region:  # per-rank stream: each rank's heads get their own dropout masks
            return causal_attention(q, k, v, p)

    def split_heads(self, qkv: torch.Tensor):
        """The fused GEMM's output → this rank's q [b, heads, s, d] and k, v [b, groups, s, d]."""
        g, rep, d = self.groups_per_rank, self.heads_per_group, self.head_dim
        if self.seq_first:
            s, b = qkv.shape[:2]
            qkv = qkv.view(s, b, g, rep + 2, d).permute(3, 1, 2, 0, 4)  # [rep + 2, b, g, s, d]
        else:
            b, s = qkv.shape[:2]
            qkv = qkv.view(b, s, g, rep + 2, d).permute(3, 0, 2, 1, 4)
        if rep == 1:
            return qkv.unbind(0)
        q = qkv[:rep].permute(1, 2, 0, 3, 4).reshape(b, g * rep, s, d)  # head = group · rep + i
        return q, qkv[rep], qkv[rep + 1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split_heads(self.qkv(x))  # with SP the GEMM's input is gathered first
        b, s, cfg = q.shape[0], q.shape[2], self.cfg
        if cfg.qk_layernorm:  # weights' gradients summed over TP: each rank normalises its heads
            q = sequence_parallel_norm(self.q_norm, q, self.group)
            k = sequence_parallel_norm(self.k_norm, k, self.group)
        if cfg.position_embedding_type == "rope":
            positions = self.positions
            if positions is None and self.ring is not None:  # this CP rank's tokens' global positions
                positions = self.ring.positions(s, q.device).unsqueeze(0)
            positions = (torch.arange(s, device=q.device) if positions is None
                         else positions.unsqueeze(1))  # [b, 1, s]: one table per sample
            cos, sin = rotary_tables(cfg, positions, q.dtype, self.inv_freq(q.device))
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = self.core(q, k, v) if self.core_runner is None else self.core_runner(self.core, q, k, v)
        heads, d = self.heads_per_rank, self.head_dim
        if self.seq_first:
            y = y.permute(2, 0, 1, 3).reshape(s, b, heads * d)
        else:
            y = y.transpose(1, 2).reshape(b, s, heads * d)
        return self.proj(y)


class ParallelMLP(nn.Module):
    """h → ffn (column-parallel, GeLU locally) → h (row-parallel): Megatron-LM §3's MLP split.

    SwiGLU (Shazeer 2020): down(silu(gate(x)) · up(x)), gate and up one column-parallel GEMM whose
    rows alternate (gate_0, up_0, gate_1, up_1, ...): every contiguous TP split then holds the
    gate rows and the up rows of the same ffn columns, whatever the TP size, so checkpoints
    reshard along dim 0 as any column-parallel weight does.
    """

    def __init__(self, cfg: GPTConfig, grid: Grid, dtype, device, sequence_parallel: bool = False):
        super().__init__()
        self.gated = cfg.gated
        fc1_out = 2 * cfg.ffn_size if self.gated else cfg.ffn_size
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, fc1_out, grid, bias=cfg.add_bias_linear,
                                        dtype=dtype, device=device,
                                        sequence_parallel=sequence_parallel)
        self.fc2 = RowParallelLinear(cfg.ffn_size, cfg.hidden_size, grid, bias=cfg.add_bias_linear,
                                     input_is_parallel=True, dtype=dtype, device=device,
                                     sequence_parallel=sequence_parallel)
        self.approximate = cfg.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc1(x)
        if self.gated:
            gate, up = y.unflatten(-1, (-1, 2)).unbind(-1)
            return self.fc2(F.silu(gate) * up)
        return self.fc2(F.gelu(y, approximate=self.approximate))


class TransformerBlock(nn.Module):
    """Pre-norm block (GPT-2's, or Llama's with the architecture fields); ``layer_id`` is its
    global index (init seeds, pipeline stages)."""

    def __init__(self, cfg: GPTConfig, grid: Grid, rng: TPRNG, layer_id: int, dtype=torch.float32, device=None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.layer_id = layer_id
        self.sequence_parallel, self.group, self.rng = sequence_parallel, grid.tp_group, rng
        self.ln1 = make_norm(cfg.normalization, cfg.hidden_size, cfg.layernorm_eps, dtype, device)
        self.attn = ParallelAttention(cfg, grid, rng, dtype, device, sequence_parallel)
        self.ln2 = make_norm(cfg.normalization, cfg.hidden_size, cfg.layernorm_eps, dtype, device)
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
