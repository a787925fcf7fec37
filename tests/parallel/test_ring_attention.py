"""Ring attention (``parallel.ring_attention``) against torch's own attention on the whole sequence.

Layouts: CP 2 and CP 4 (gloo ranks). Reference: ``F.scaled_dot_product_attention`` (causal, or
with the dense document-causal mask) of the whole float64 sequence on each rank, its output and
the gradients of q, k, v, cut into the rank's two chunks. Tolerance: 1e-10 relative (float64).
The bytes sent on the CP group, counted by ``CommStats``, equal the formula: forward passes K/V
on cp - 1 times, backward passes K/V on cp - 1 times and dK/dV cp times, each 2·b·g·(s/cp)·d
elements.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.harness import spawn
from zerotron.parallel import Grid, ParallelDims
from zerotron.parallel.context_parallel import local_chunks
from zerotron.parallel.ring_attention import RingContext, ring_attention


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def ring_vs_whole(cp, heads, groups, documents):
    torch.set_num_threads(1)
    grid = Grid(ParallelDims(cp=cp))
    ring = RingContext(grid.cp_group, grid.cp_rank, cp)
    b, s, d = 2, 8 * cp, 4
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(b, heads, s, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, groups, s, d, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    dout = torch.randn(b, heads, s, d, generator=gen, dtype=torch.float64)
    doc = None
    if documents:  # documents of random lengths, crossing chunk boundaries
        doc = torch.cumsum((torch.rand(b, s, generator=gen) < 0.15).long(), dim=1)
        mask = (doc.unsqueeze(2) == doc.unsqueeze(1)) & torch.ones(s, s, dtype=torch.bool).tril()
        whole = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1),
                                               enable_gqa=groups != heads)
    else:
        whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups != heads)
    whole.backward(dout)
    mine = [local_chunks(t.detach(), grid.cp_rank, cp, dim=2).requires_grad_() for t in (q, k, v)]
    mark = grid.stats.snapshot()
    out = ring_attention(*mine, ring, doc)
    out.backward(local_chunks(dout, grid.cp_rank, cp, dim=2))
    sent = grid.stats.since(mark).get("send", "cp").bytes
    kv_bytes = 2 * b * groups * (s // cp) * d * 8
    assert sent == (2 * (cp - 1) + cp) * kv_bytes, (sent, kv_bytes)
    errors = [_rel(out.detach(), local_chunks(whole.detach(), grid.cp_rank, cp, dim=2))]
    errors += [_rel(m.grad, local_chunks(t.grad, grid.cp_rank, cp, dim=2))
               for m, t in zip(mine, (q, k, v))]
    grid.close()
    return errors, None


@pytest.mark.parametrize("cp,heads,groups,documents", [
    (2, 4, 4, False), (4, 4, 2, True),
])
def test_ring_attention_equals_whole_sequence_attention(cp, heads, groups, documents):
    for errors, _ in spawn(ring_vs_whole, cp, cp, heads, groups, documents, timeout=120):
        assert max(errors) < 1e-10, errors
