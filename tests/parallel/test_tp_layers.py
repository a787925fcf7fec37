"""TP building blocks on gloo ranks (TP = 2 and 4, fp32) against single-process torch.

References, computed on every rank from the same seeded inputs: ``F.cross_entropy`` on the
gathered logits; ``nn.Linear`` / ``F.embedding`` on the unsharded weights; plain autograd for the
f/g/gather/scatter mappings. Also the TP RNG (per-rank vs shared streams, exact state restore).
"""

import pytest
import torch
import torch.nn.functional as F

from tests.harness import spawn
from zerotron.parallel import Grid, ParallelDims
from zerotron.parallel.cross_entropy import vocab_parallel_cross_entropy
from zerotron.parallel.rng import TPRNG
from zerotron.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from zerotron.parallel.tp_mappings import (
    copy_to_tp_region, gather_from_tp_region, reduce_from_tp_region, scatter_to_tp_region)

TOL = dict(rtol=1e-5, atol=1e-6)


def check_cross_entropy(tp, vocab):
    grid = Grid(ParallelDims(tp=tp))
    rank = grid.tp_rank
    per_rank = -(-vocab // tp)
    padded = per_rank * tp
    g = torch.Generator().manual_seed(vocab)
    full = torch.randn(3, 5, padded, generator=g) * 3
    full[..., vocab:] = 1e4  # garbage in the padding: it must never win the softmax
    target = torch.randint(0, vocab, (3, 5), generator=g)
    target[0, 0] = -100  # ignored token
    weights = torch.rand(3, 5, generator=g)

    ref_in = full[..., :vocab].clone().requires_grad_(True)
    ref = F.cross_entropy(ref_in.reshape(-1, vocab), target.reshape(-1), reduction="none").view(3, 5)
    (ref * weights).sum().backward()

    local = full.chunk(tp, dim=-1)[rank].clone().requires_grad_(True)
    grid.stats.reset()
    loss = vocab_parallel_cross_entropy(local, target, grid.tp_group, rank * per_rank, vocab)
    ar = grid.stats.get("all_reduce", "tp")
    assert (ar.calls, ar.elements) == (3, 3 * 2 * 15), ar  # max, target logit, Σexp: b×s each
    assert grid.stats.total(op="all_gather").calls == 0
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref.detach(), **TOL)
    (loss * weights).sum().backward()
    assert grid.stats.get("all_reduce", "tp").calls == 3  # backward is local
    ref_grad = torch.cat([ref_in.grad, torch.zeros(3, 5, padded - vocab)], dim=-1)
    torch.testing.assert_close(local.grad, ref_grad.chunk(tp, dim=-1)[rank], **TOL)
    assert torch.equal(local.detach(), full.chunk(tp, dim=-1)[rank])  # caller's logits untouched

    # bf16 logits: loss still fp32, gradient back in bf16
    lb = full.chunk(tp, dim=-1)[rank].bfloat16().requires_grad_(True)
    out = vocab_parallel_cross_entropy(lb, target, grid.tp_group, rank * per_rank, vocab)
    out.sum().backward()
    assert out.dtype == torch.float32 and lb.grad.dtype == torch.bfloat16
    return True


@pytest.mark.parametrize("tp,vocab", [(2, 7), (4, 10), (4, 16)])
def test_vocab_parallel_cross_entropy_equals_torch(tp, vocab):
    assert all(spawn(check_cross_entropy, tp, tp, vocab, timeout=60))


def check_layers_and_mappings(tp):
    grid = Grid(ParallelDims(tp=tp))
    rank, group = grid.tp_rank, grid.tp_group
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 8, generator=g)
    w1, b1 = torch.randn(12, 8, generator=g), torch.randn(12, generator=g)
    w2, b2 = torch.randn(8, 12, generator=g), torch.randn(8, generator=g)
    upstream = torch.randn(2, 3, 8, generator=g)

    xr = x.clone().requires_grad_(True)
    ref = F.linear(F.gelu(F.linear(xr, w1, b1)), w2, b2)
    (ref * upstream).sum().backward()

    col = ColumnParallelLinear(8, 12, grid)
    row = RowParallelLinear(12, 8, grid)
    splits = (col.weight.tp_split_dim, col.bias.tp_split_dim, row.weight.tp_split_dim, row.bias.tp_split_dim)
    assert splits == (0, 0, 1, None)
    with torch.no_grad():
        col.weight.copy_(w1.chunk(tp, 0)[rank]); col.bias.copy_(b1.chunk(tp, 0)[rank])
        row.weight.copy_(w2.chunk(tp, 1)[rank]); row.bias.copy_(b2)
    xt = x.clone().requires_grad_(True)
    out = row(F.gelu(col(xt)))
    torch.testing.assert_close(out, ref.detach(), **TOL)
    (out * upstream).sum().backward()
    torch.testing.assert_close(xt.grad, xr.grad, **TOL)  # f all-reduced the partial input grads

    # gather_output / unsplit input variants
    col_g = ColumnParallelLinear(8, 12, grid, gather_output=True)
    row_s = RowParallelLinear(12, 8, grid, input_is_parallel=False)
    with torch.no_grad():
        col_g.weight.copy_(w1.chunk(tp, 0)[rank]); col_g.bias.copy_(b1.chunk(tp, 0)[rank])
        row_s.weight.copy_(w2.chunk(tp, 1)[rank]); row_s.bias.copy_(b2)
    torch.testing.assert_close(row_s(col_g(x)), F.linear(F.linear(x, w1, b1), w2, b2), **TOL)

    # mappings: forward values and backward conjugates
    a = torch.randn(4, 2 * tp, generator=g)
    mine = (a + rank).requires_grad_(True)
    red = reduce_from_tp_region(mine, group)
    torch.testing.assert_close(red, sum(a + r for r in range(tp)))
    red.sum().backward()
    assert torch.equal(mine.grad, torch.ones_like(a))  # g: identity backward
    c = a.clone().requires_grad_(True)
    (copy_to_tp_region(c, group) * (rank + 1)).sum().backward()
    torch.testing.assert_close(c.grad, torch.full_like(a, sum(range(1, tp + 1))))  # f: all-reduce backward
    s = a.clone().requires_grad_(True)
    piece = scatter_to_tp_region(s, group)
    assert torch.equal(piece, a.chunk(tp, -1)[rank])
    gathered = gather_from_tp_region(piece, group)
    assert torch.equal(gathered, a)
    (gathered * a).sum().backward()
    torch.testing.assert_close(s.grad, a)

    # vocab-parallel embedding vs F.embedding, grads only on this rank's rows
    table = torch.randn(8 * tp, 5, generator=g)
    ids = torch.randint(0, 8 * tp, (3, 4), generator=g)
    emb = VocabParallelEmbedding(8 * tp, 5, grid)
    with torch.no_grad():
        emb.weight.copy_(table.chunk(tp, 0)[rank])
    out = emb(ids)
    torch.testing.assert_close(out, F.embedding(ids, table))
    out.sum().backward()
    tr = table.clone().requires_grad_(True)
    F.embedding(ids, tr).sum().backward()
    torch.testing.assert_close(emb.weight.grad, tr.grad.chunk(tp, 0)[rank])
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_layers_and_mappings_equal_torch(tp):
    assert all(spawn(check_layers_and_mappings, tp, tp, timeout=60))


def check_rng():
    import torch.distributed as dist

    grid = Grid(ParallelDims(tp=2))
    rng = TPRNG()
    rng.seed(42, grid)
    shared_a = torch.rand(4)
    with rng.fork():
        region_a = torch.rand(4)
    shared_b = torch.rand(4)
    states = rng.get_states()
    with rng.fork():
        region_b = torch.rand(4)
    shared_c = torch.rand(4)
    rng.set_states(states)  # replay exactly (what recompute relies on)
    with rng.fork():
        assert torch.equal(torch.rand(4), region_b)
    assert torch.equal(torch.rand(4), shared_c)

    # shared stream unaffected by the fork: same as a plain generator with the shared seed
    plain = torch.Generator().manual_seed(42)
    assert torch.equal(shared_a, torch.rand(4, generator=plain))
    assert torch.equal(shared_b, torch.rand(4, generator=plain))
    everyone = [torch.empty(8) for _ in range(2)]
    dist.all_gather(everyone, torch.cat([shared_a, region_a]))
    assert torch.equal(everyone[0][:4], everyone[1][:4])  # shared: equal across TP ranks
    assert not torch.equal(everyone[0][4:], everyone[1][4:])  # TP region: differs per rank
    with pytest.raises(ValueError, match="unknown RNG state"):
        rng.set_states({"bogus": torch.zeros(1)})
    with pytest.raises(RuntimeError, match="seed"):
        with TPRNG().fork():
            pass
    return True


def test_tp_rng_streams():
    assert all(spawn(check_rng, 2, timeout=60))
