"""TP building blocks on gloo ranks (TP = 2 and 4) against single-process torch, in the tiers of
``tests/parity.py``.

References, computed on every rank from the same seeded inputs: ``F.cross_entropy`` on the
gathered logits; ``F.linear`` / ``F.embedding`` on the unsharded weights; plain autograd for the
f/g/gather/scatter mappings. Also the TP RNG (per-rank vs shared streams, exact state restore).

* float64: cross-entropy (loss and logit gradient) and the column/row-parallel linears (output,
  input and weight gradients) in float64 against torch in float64, to ``FP64_TP_PP``.
* fp32: the same in fp32 against that float64 truth, within twice torch fp32's own error
  (``assert_fp32``).
* bitwise: the mappings and the vocab-parallel embedding, on integer-valued data or data that
  is only moved, masked and summed with zeros -- sums that are exact in any order.

Cross-entropy runs on two kinds of logits: moderate ones (N(0, 9)) and large ones (a per-row
offset of 1e3-1e4 plus N(0, 400)), where exp overflows in fp32 and float64 unless the global
row maximum is subtracted first.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.harness import spawn
from tests.parity import FP64_TP_PP, assert_bitwise, assert_fp32, assert_fp64
from zerotron.parallel import Grid, ParallelDims
from zerotron.parallel.cross_entropy import vocab_parallel_cross_entropy
from zerotron.parallel.rng import TPRNG
from zerotron.parallel.shard_info import shard_info
from zerotron.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from zerotron.parallel.tp_mappings import (
    copy_to_tp_region, gather_from_tp_region, reduce_from_tp_region, scatter_to_tp_region)


def compare(got, truth, torch32, what):
    """float64 results against the float64 truth; fp32 ones relative to torch's own fp32 error."""
    if got.dtype == torch.float64:
        assert_fp64(got, truth, FP64_TP_PP, what)
    else:
        assert_fp32(got, truth, torch32, what)


def gather(t, dim, group):
    """The full tensor from every TP rank's piece along ``dim``."""
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(group.size)]
    dist.all_gather(parts, t.contiguous(), group=group.pg)
    return torch.cat(parts, dim=dim)


def torch_cross_entropy(full, target, weights, vocab):
    """torch's per-token loss and logit gradient (zero on the padding columns) in full's dtype."""
    x = full[..., :vocab].clone().requires_grad_(True)
    loss = F.cross_entropy(x.reshape(-1, vocab), target.reshape(-1), reduction="none").view(target.shape)
    (loss * weights.to(full.dtype)).sum().backward()
    return loss.detach(), torch.cat([x.grad, x.grad.new_zeros(*target.shape, full.shape[-1] - vocab)], -1)


def check_cross_entropy(tp, vocab):
    grid = Grid(ParallelDims(tp=tp))
    rank = grid.tp_rank
    per_rank = -(-vocab // tp)
    padded = per_rank * tp
    padding = torch.arange(rank * per_rank, (rank + 1) * per_rank) >= vocab
    g = torch.Generator().manual_seed(vocab)
    target = torch.randint(0, vocab, (3, 5), generator=g)
    target[0, 0] = -100  # ignored token
    weights = torch.rand(3, 5, generator=g)
    moderate = torch.randn(3, 5, padded, generator=g) * 3
    large = torch.empty(3, 5, 1).uniform_(1e3, 1e4, generator=g) + torch.randn(3, 5, padded, generator=g) * 20
    for kind, full in (("large", large), ("moderate", moderate)):
        full[..., vocab:] = 2e4  # garbage in the padding: it must never win the softmax
        truth = torch_cross_entropy(full.double(), target, weights, vocab)
        torch32 = torch_cross_entropy(full, target, weights, vocab)
        for dtype in (torch.float64, torch.float32):
            what = f"tp={tp} vocab={vocab} {kind} logits {dtype}"
            mine = full.to(dtype).chunk(tp, dim=-1)[rank]
            local = mine.clone().requires_grad_(True)
            mark = grid.stats.snapshot()
            loss = vocab_parallel_cross_entropy(local, target, grid.tp_group, rank * per_rank, vocab)
            ar = grid.stats.since(mark).get("all_reduce", "tp")
            assert (ar.calls, ar.elements) == (3, 3 * 2 * 15), ar  # max, target logit, Σexp: b×s each
            assert grid.stats.since(mark).total(op="all_gather").calls == 0
            assert loss.dtype == dtype, what  # float64 stays float64, fp32 and below give fp32
            compare(loss.detach(), truth[0], torch32[0], f"{what}: loss")
            (loss * weights.to(dtype)).sum().backward()
            assert grid.stats.since(mark).get("all_reduce", "tp").calls == 3  # backward is local
            compare(gather(local.grad, -1, grid.tp_group), truth[1], torch32[1], f"{what}: grad")
            assert not local.grad[..., padding].any(), what  # padding: probability and gradient exactly 0
            assert_bitwise(local.detach(), mine, f"{what}: caller's logits untouched")

    # bf16 logits: loss still fp32, gradient back in bf16
    lb = moderate.chunk(tp, dim=-1)[rank].bfloat16().requires_grad_(True)
    out = vocab_parallel_cross_entropy(lb, target, grid.tp_group, rank * per_rank, vocab)
    out.sum().backward()
    assert out.dtype == torch.float32 and lb.grad.dtype == torch.bfloat16
    return True


@pytest.mark.parametrize("tp,vocab", [(2, 7), (4, 10), (4, 16)])
def test_vocab_parallel_cross_entropy_equals_torch(tp, vocab):
    assert all(spawn(check_cross_entropy, tp, tp, vocab, timeout=60))


def torch_mlp(x, w1, b1, w2, b2, upstream):
    """F.linear-GeLU-F.linear on full weights in x's dtype: outputs and the five gradients."""
    leaves = [t.to(x.dtype, copy=True).requires_grad_(True) for t in (x, w1, b1, w2, b2)]
    xr, w1r, b1r, w2r, b2r = leaves
    out = F.linear(F.gelu(F.linear(xr, w1r, b1r)), w2r, b2r)
    (out * upstream.to(x.dtype)).sum().backward()
    plain = F.linear(F.linear(xr, w1r, b1r), w2r, b2r)  # the gather_output / unsplit-input path
    return [out.detach(), plain.detach()] + [t.grad for t in leaves]


def check_linears(grid, g):
    """Column- then row-parallel linear vs F.linear; sharded gradients are gathered and judged
    whole, so the fp32 bound is the maximum over the full tensor, the same on every rank."""
    tp, rank, group = grid.tp_size, grid.tp_rank, grid.tp_group
    h, ffn = 32, 64
    x = torch.randn(4, 16, h, generator=g)
    w1, b1 = torch.randn(ffn, h, generator=g), torch.randn(ffn, generator=g)
    w2, b2 = torch.randn(h, ffn, generator=g), torch.randn(h, generator=g)
    upstream = torch.randn(4, 16, h, generator=g)
    truth = torch_mlp(x.double(), w1, b1, w2, b2, upstream)
    torch32 = torch_mlp(x, w1, b1, w2, b2, upstream)
    names = ["out", "out (gather_output, unsplit input)", "x.grad", "w1.grad", "b1.grad", "w2.grad", "b2.grad"]

    for dtype in (torch.float64, torch.float32):
        col = ColumnParallelLinear(h, ffn, grid, dtype=dtype)
        row = RowParallelLinear(ffn, h, grid, dtype=dtype)
        col_g = ColumnParallelLinear(h, ffn, grid, gather_output=True, dtype=dtype)
        row_s = RowParallelLinear(ffn, h, grid, input_is_parallel=False, dtype=dtype)
        splits = tuple(shard_info(p).tp_split_dim for p in (col.weight, col.bias, row.weight, row.bias))
        assert splits == (0, 0, 1, None)
        with torch.no_grad():
            for c, r in ((col, row), (col_g, row_s)):
                c.weight.copy_(w1.chunk(tp, 0)[rank]); c.bias.copy_(b1.chunk(tp, 0)[rank])
                r.weight.copy_(w2.chunk(tp, 1)[rank]); r.bias.copy_(b2)
        xt = x.to(dtype, copy=True).requires_grad_(True)
        out = row(F.gelu(col(xt)))
        (out * upstream.to(dtype)).sum().backward()  # x.grad: f all-reduced the partial input grads
        got = [out.detach(), row_s(col_g(x.to(dtype))).detach(), xt.grad, gather(col.weight.grad, 0, group),
               gather(col.bias.grad, 0, group), gather(row.weight.grad, 1, group), row.bias.grad]
        for name, value, want, want32 in zip(names, got, truth, torch32):
            compare(value, want, want32, f"tp={tp} {dtype}: {name}")


def check_layers_and_mappings(tp):
    grid = Grid(ParallelDims(tp=tp))
    rank, group = grid.tp_rank, grid.tp_group
    g = torch.Generator().manual_seed(1)
    check_linears(grid, g)

    # mappings on integer-valued data: forward values and backward conjugates, exact
    a = torch.randint(-8, 9, (4, 2 * tp), generator=g).float()
    mine = (a + rank).requires_grad_(True)
    red = reduce_from_tp_region(mine, group)
    assert_bitwise(red, sum(a + r for r in range(tp)), "g forward: all-reduce")
    red.sum().backward()
    assert_bitwise(mine.grad, torch.ones_like(a), "g backward: identity")
    c = a.clone().requires_grad_(True)
    (copy_to_tp_region(c, group) * (rank + 1)).sum().backward()
    assert_bitwise(c.grad, torch.full_like(a, sum(range(1, tp + 1))), "f backward: all-reduce")
    s = a.clone().requires_grad_(True)
    piece = scatter_to_tp_region(s, group)
    assert_bitwise(piece, a.chunk(tp, -1)[rank], "scatter forward")
    gathered = gather_from_tp_region(piece, group)
    assert_bitwise(gathered, a, "gather forward")
    (gathered * a).sum().backward()
    assert_bitwise(s.grad, a, "gather backward (split), scatter backward (gather)")

    # vocab-parallel embedding vs F.embedding: rows looked up, others zeroed, summed; grads only on
    # this rank's rows (sums of ones)
    table = torch.randn(8 * tp, 5, generator=g)
    ids = torch.randint(0, 8 * tp, (3, 4), generator=g)
    emb = VocabParallelEmbedding(8 * tp, 5, grid)
    with torch.no_grad():
        emb.weight.copy_(table.chunk(tp, 0)[rank])
    out = emb(ids)
    assert_bitwise(out, F.embedding(ids, table), "embedding forward")
    out.sum().backward()
    tr = table.clone().requires_grad_(True)
    F.embedding(ids, tr).sum().backward()
    assert_bitwise(emb.weight.grad, tr.grad.chunk(tp, 0)[rank], "embedding grad")
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
