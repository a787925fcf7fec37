"""Ring attention over the CP group (Liu et al. 2023; Megatron-core's p2p context parallelism).

Each CP rank holds chunks i and 2·cp-1-i of the sequence (``parallel.context_parallel``) and its
own queries, keys and values for them. The K/V of every rank travel once around the ring: at
step t rank i holds the K/V of rank j = i - t (mod cp), computes its queries against them while
the next step's K/V are already in flight (one batched isend/irecv per step, posted before the
block's compute), and merges the block's partial output with the running one by their
log-sum-exp (the online softmax: out = Σ_j exp(lse_j - lse) · out_j, lse = log Σ_j exp(lse_j)).

The two-chunk layout makes each block's causal mask simple, as Megatron-core's ``cp`` kernels:
- j = i: both chunks against both, causal (the local order is the global order);
- j < i: rank j's first chunk lies before both of ours, its second after both: every query
  against j's first half, no mask;
- j > i: both of j's chunks lie after our first and before our second: our second half against
  all of j's keys, no mask.
So half of each off-diagonal block is skipped, and every rank does the same work.

With document masking each block also compares the document ids of its queries and keys, taken
from the whole sequence's ids every rank holds (a document may cross chunk boundaries).

Backward (flash-attention's recurrence, with the final lse and D = rowsum(dO·O)) sends the K/V
around the ring again, and with them an accumulator of dK/dV: each rank adds its queries'
contribution to the K/V it holds and passes the sum on; after cp steps and one last pass every
dK/dV is home. Blocks are computed in fp32 for 16-bit inputs and in float64 for float64 ones
(the parity tests): on a CPU without document masking by torch's flash kernel for CPU, which
returns the block's log-sum-exp and keeps O(s/cp) per head; otherwise with dense scores (a
GPU, and document masks: b·heads·(s/cp)² transient per block). Grouped-query attention: K/V
carry query-group heads, expanded per block and their gradients summed back over each group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from zerotron.parallel import p2p
from zerotron.parallel.context_parallel import local_chunks, local_positions
from zerotron.parallel.grid import Group


@dataclass
class RingContext:
    """This rank's place in the CP ring: the group, its index in it and the ring's size."""

    group: Group
    rank: int
    size: int

    def positions(self, local_len: int, device=None) -> torch.Tensor:
        """Global positions [local_len] of this rank's tokens (local_len = s / cp)."""
        return local_positions(local_len * self.size, self.rank, self.size, device)

    def exchange(self, tensor: torch.Tensor) -> tuple[torch.Tensor, p2p.Handle]:
        """Send ``tensor`` to the next rank of the ring and receive the previous rank's into a new
        buffer; returns (buffer, handle) at once."""
        buf = torch.empty_like(tensor)
        nxt = self.group.ranks[(self.rank + 1) % self.size]
        prv = self.group.ranks[(self.rank - 1) % self.size]
        ops = [p2p.P2POp("send", tensor, nxt), p2p.P2POp("recv", buf, prv)]
        return buf, p2p.batch(ops, self.group)


def _rows_cols(i: int, j: int, n: int):
    """Query rows and key columns of block (i, j) that can see each other, and whether the block
    is causal (module docstring); n = local length."""
    if j == i:
        return slice(0, n), slice(0, n), True
    if j < i:
        return slice(0, n), slice(0, n // 2), False
    return slice(n // 2, n), slice(0, n), False


def _mask(causal: bool, rows: int, cols: int, doc_q, doc_k, device):
    """[b or 1, 1, rows, cols] bool mask of what a query may see, or None for all of it."""
    mask = torch.ones(rows, cols, dtype=torch.bool, device=device).tril() if causal else None
    if doc_q is not None:
        same = (doc_q.unsqueeze(2) == doc_k.unsqueeze(1))  # [b, rows, cols]
        mask = same if mask is None else same & mask
    return None if mask is None else (mask.unsqueeze(1) if mask.dim() == 3 else mask)


def _expand(t: torch.Tensor, rep: int) -> torch.Tensor:
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def _reduce_groups(t: torch.Tensor, rep: int) -> torch.Tensor:
    if rep == 1:
        return t
    b, h, n, d = t.shape
    return t.view(b, h // rep, rep, n, d).sum(2)


def _scores(q, k, scale, mask):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _fused(q, mask_free: bool) -> bool:
    """torch's flash kernel for CPU: exact, with the log-sum-exp, no mask argument needed."""
    return mask_free and q.device.type == "cpu"


def _block_forward(q, k, v, scale, mask, causal):
    """Exact attention of one block: its output and log-sum-exp (-inf where a row sees nothing)."""
    if _fused(q, mask is None or (causal and mask.dim() == 2)):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, scale=scale)
    s = _scores(q, k, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)  # rows that see nothing: 0, not NaN
    return torch.matmul(p, v), lse


def _block_backward(q, k, v, out, lse, dout, delta, scale, mask, causal):
    """One block's share of dQ, dK, dV from the *final* output and log-sum-exp (flash
    attention's backward: P = exp(S - lse), dS = P ∘ (dO·Vᵀ - rowsum(dO ∘ O)))."""
    if _fused(q, mask is None or (causal and mask.dim() == 2)):
        c = [t.contiguous() for t in (dout, q, k, v, out, lse)]
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *c, 0.0, causal, scale=scale)
    p = torch.exp(_scores(q, k, scale, mask) - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dout)
    ds = p * (torch.matmul(dout, v.transpose(-1, -2)) - delta.unsqueeze(-1))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, dv


def _merge(out, lse, out_b, lse_b):
    """out, lse ← their log-sum-exp merge with a block's (in place on the given views)."""
    new = torch.logaddexp(lse, lse_b)
    finite = torch.isfinite(new)
    w_old = torch.where(finite, torch.exp(lse - new), torch.zeros_like(new))
    w_new = torch.where(finite, torch.exp(lse_b - new), torch.zeros_like(new))
    out.copy_(out * w_old.unsqueeze(-1) + out_b * w_new.unsqueeze(-1))
    lse.copy_(new)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _block_at(ring, step: int, n: int, documents, doc_q, device):
    """Step ``step``'s block: this rank's query rows against the key columns of the K/V it holds
    then (rank ``j = i - step``'s), whether it is causal, and its document mask (or None)."""
    j = (ring.rank - step) % ring.size
    rows, cols, causal = _rows_cols(ring.rank, j, n)
    doc_k = None if documents is None else local_chunks(documents, j, ring.size)[:, cols]
    mask = _mask(causal, n if causal else rows.stop - rows.start, cols.stop,
                 None if doc_q is None else doc_q[:, rows], doc_k, device)
    return rows, cols, causal, mask


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: RingContext, documents):
        ctx.ring, ctx.documents = ring, documents
        dt = _compute_dtype(q.dtype)
        qc, kv = q.to(dt), torch.stack([k, v]).to(dt)
        b, h, n, d = q.shape
        rep, scale = h // k.shape[1], 1.0 / math.sqrt(d)
        out = torch.zeros(b, h, n, d, dtype=dt, device=q.device)
        lse = torch.full((b, h, n), float("-inf"), dtype=dt, device=q.device)
        doc_q = None if documents is None else local_chunks(documents, ring.rank, ring.size)
        for step in range(ring.size):
            handle = None
            if step + 1 < ring.size:  # the next block's K/V travel while this one computes
                nxt, handle = ring.exchange(kv)
            rows, cols, causal, mask = _block_at(ring, step, n, documents, doc_q, q.device)
            out_b, lse_b = _block_forward(qc[:, :, rows], _expand(kv[0][:, :, cols], rep),
                                          _expand(kv[1][:, :, cols], rep), scale, mask, causal)
            _merge(out[:, :, rows], lse[:, :, rows], out_b, lse_b)
            if handle is not None:
                handle.wait()
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, documents = ctx.ring, ctx.documents
        dt = out.dtype
        qc, kv, do = q.to(dt), torch.stack([k, v]).to(dt), dout.to(dt)
        b, h, n, d = q.shape
        rep, scale = h // k.shape[1], 1.0 / math.sqrt(d)
        delta = (do * out).sum(-1)  # D = rowsum(dO · O)
        dq = torch.zeros_like(qc)
        dkv = torch.zeros_like(kv)  # the gradient of the K/V this rank holds now, summed so far
        doc_q = None if documents is None else local_chunks(documents, ring.rank, ring.size)
        for step in range(ring.size):
            handle = None
            if step + 1 < ring.size:
                nxt, handle = ring.exchange(kv)
            rows, cols, causal, mask = _block_at(ring, step, n, documents, doc_q, q.device)
            kb, vb = _expand(kv[0][:, :, cols], rep), _expand(kv[1][:, :, cols], rep)
            dqb, dkb, dvb = _block_backward(qc[:, :, rows], kb, vb, out[:, :, rows],
                                            lse[:, :, rows], do[:, :, rows], delta[:, :, rows],
                                            scale, mask, causal)
            dq[:, :, rows] += dqb
            dkv[0][:, :, cols] += _reduce_groups(dkb, rep)
            dkv[1][:, :, cols] += _reduce_groups(dvb, rep)
            if handle is not None:
                handle.wait()
                kv = nxt
            # pass the sum on with the K/V it belongs to; the last pass brings each rank its own
            dkv, back = ring.exchange(dkv)
            back.wait()
        ctx.ring = ctx.documents = None
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingContext,
                   documents: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries [b, heads, s/cp, d] against the whole sequence's
    keys and values (k, v [b, groups, s/cp, d] here, the rest around the ring); ``documents``:
    the whole sequence's document ids [b, s] (document masking), or None."""
    return _RingAttention.apply(q, k, v, ring, documents)
