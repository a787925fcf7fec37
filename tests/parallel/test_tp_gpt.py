"""Tensor-parallel GPT on TP = 2 and 4 gloo ranks against a single-process reference, in the
tiers of ``tests/parity.py``.

Reference: a plain nanoGPT-style model written here (nn.Linear / nn.Embedding, explicit causal
softmax attention, F.cross_entropy on full logits), with random weights -- including non-trivial
biases and LayerNorm affines. Its weights are sharded *by hand* into the TP model (the fused QKV
rows reordered to Megatron's head-major layout, column-parallel weights split on dim 0,
row-parallel on dim 1, the vocabulary padded and split on dim 0). Compared: logits, loss and
every parameter gradient.

* float64: the TP model and the reference both in float64, to ``FP64_TP_PP`` (splitting the
  GEMMs and the softmax over ranks only reorders sums; a wrong shard or a missed all-reduce is
  off by far more).
* fp32: the fp32 TP model against the float64 reference, within twice the fp32 reference's own
  error against that same truth (``assert_fp32``), so the bound follows the machine's kernels.

The fp32 and float64 references hold the same weights (fp32 values, exact in float64).
The communication counts are exact in both precisions.
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.harness import spawn
from tests.parity import FP64_TP_PP, assert_bitwise, assert_fp32, assert_fp64
from zerotron.model import GPT, GPTConfig
from zerotron.parallel import Grid, ParallelDims
from zerotron.parallel.shard_info import shard_info


class RefBlock(nn.Module):
    def __init__(self, h, nh):
        super().__init__()
        self.nh = nh
        self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.c_attn, self.c_proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.c_fc, self.c_fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def attn(self, x):
        b, s, h = x.shape
        q, k, v = self.c_attn(x).split(h, dim=2)
        q, k, v = (t.view(b, s, self.nh, h // self.nh).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(h // self.nh)
        att = att.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return self.c_proj((att @ v).transpose(1, 2).reshape(b, s, h))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_fc2(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class RefGPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.seq_length, cfg.hidden_size)
        self.h = nn.ModuleList(RefBlock(cfg.hidden_size, cfg.num_heads) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for blk in self.h:
            x = blk(x)
        return self.ln_f(x) @ self.wte.weight.t()  # tied output layer


def make_cfg(**kw):
    base = dict(num_layers=2, hidden_size=32, num_heads=4, vocab_size=90, seq_length=16,
                make_vocab_size_divisible_by=8)
    base.update(kw)
    return GPTConfig(**base)


def reference(cfg):
    torch.manual_seed(0)
    ref = RefGPT(cfg)
    with torch.no_grad():  # GPT-2-scale weights; LN affines and biases made non-trivial
        for name, p in ref.named_parameters():
            if "ln" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.02 if p.ndim > 1 else 0.01)
    return ref


def shard(full, dim, tp, rank):
    return full if dim is None else full.chunk(tp, dim=dim)[rank]


def head_major(w, nh):
    """[q; k; v] rows (nanoGPT) → rows ordered (head, {q,k,v}, head_dim) (Megatron)."""
    three_h = w.shape[0]
    hd = three_h // 3 // nh
    return w.reshape(3, nh, hd, *w.shape[1:]).transpose(0, 1).reshape(three_h, *w.shape[1:])


def ref_tensors(ref, cfg, tp, attr):
    """Map TP-model parameter names to the reference tensor (weight or grad), padded, unsharded."""
    get = (lambda p: p.detach()) if attr == "data" else (lambda p: p.grad)
    vp = cfg.padded_vocab_size(tp)
    wte = get(ref.wte.weight)
    out = {"embedding.word.weight": torch.cat([wte, wte.new_zeros(vp - cfg.vocab_size, cfg.hidden_size)]),
           "embedding.position": get(ref.wpe.weight), "final_ln.weight": get(ref.ln_f.weight),
           "final_ln.bias": get(ref.ln_f.bias)}
    for i, b in enumerate(ref.h):
        pre = f"blocks.{i}."
        out.update({
            pre + "ln1.weight": get(b.ln_1.weight), pre + "ln1.bias": get(b.ln_1.bias),
            pre + "ln2.weight": get(b.ln_2.weight), pre + "ln2.bias": get(b.ln_2.bias),
            pre + "attn.qkv.weight": head_major(get(b.c_attn.weight), cfg.num_heads),
            pre + "attn.qkv.bias": head_major(get(b.c_attn.bias), cfg.num_heads),
            pre + "attn.proj.weight": get(b.c_proj.weight), pre + "attn.proj.bias": get(b.c_proj.bias),
            pre + "mlp.fc1.weight": get(b.c_fc.weight), pre + "mlp.fc1.bias": get(b.c_fc.bias),
            pre + "mlp.fc2.weight": get(b.c_fc2.weight), pre + "mlp.fc2.bias": get(b.c_fc2.bias),
        })
    return out


# Sharding plan written independently of the code under test (not read from its ShardInfo).
SPLIT = {"embedding.word.weight": 0, "attn.qkv.weight": 0, "attn.qkv.bias": 0, "mlp.fc1.weight": 0,
         "mlp.fc1.bias": 0, "attn.proj.weight": 1, "mlp.fc2.weight": 1}


def split_of(name):
    return next((d for k, d in SPLIT.items() if name.endswith(k)), None)


def run_reference(ref, cfg, tp, rank, ids, labels):
    """Logits, loss and this rank's shard of every gradient, keyed like the TP model."""
    logits = ref(ids)
    loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), labels.reshape(-1))
    loss.backward()
    grads = {n: shard(g, split_of(n), tp, rank) for n, g in ref_tensors(ref, cfg, tp, "grad").items()}
    return {"logits": logits.detach(), "loss": loss.detach(), **grads}


def run_tp(cfg, grid, dtype, weights, ids, labels):
    """The TP model with the reference's weights: its results keyed like ``run_reference``, the
    forward / backward TP all-reduce counters, and the model."""
    import torch.distributed as dist

    tp, rank = grid.tp_size, grid.tp_rank
    model = GPT(cfg, grid, dtype=dtype, seed=7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            assert shard_info(p, name).tp_split_dim == split_of(name), name  # what checkpoints/ZeRO rely on
            p.copy_(shard(weights[name], split_of(name), tp, rank))
        local = model(ids)
        gathered = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(gathered, local.contiguous(), group=grid.tp_group.pg)
        logits = torch.cat(gathered, dim=-1)
    assert (logits[..., cfg.vocab_size:] < -1e30).all()  # padding never wins

    mark = grid.stats.snapshot()
    loss = model(ids, labels)
    fwd = grid.stats.since(mark).get("all_reduce", "tp")
    loss.backward()
    bwd = grid.stats.since(mark).get("all_reduce", "tp")
    out = {"logits": logits[..., : cfg.vocab_size], "loss": loss.detach()}
    out.update((name, p.grad) for name, p in model.named_parameters())
    return out, fwd, bwd, model


def check_tp_equals_reference(tp):
    cfg = make_cfg()
    grid = Grid(ParallelDims(tp=tp))
    ref32 = reference(cfg)
    ref64 = copy.deepcopy(ref32).double()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    truth = run_reference(ref64, cfg, tp, grid.tp_rank, ids, labels)
    torch32 = run_reference(ref32, cfg, tp, grid.tp_rank, ids, labels)

    bsh, bs, L = 2 * cfg.seq_length * cfg.hidden_size, 2 * cfg.seq_length, cfg.num_layers
    for dtype, ref in ((torch.float64, ref64), (torch.float32, ref32)):
        got, fwd, bwd, model = run_tp(cfg, grid, dtype, ref_tensors(ref, cfg, tp, "data"), ids, labels)
        assert got.keys() == truth.keys()
        for name, value in got.items():
            what = f"tp={tp} {dtype}: {name}"
            if dtype == torch.float64:
                assert_fp64(value, truth[name], FP64_TP_PP, what)
            else:
                assert_fp32(value, truth[name], torch32[name], what)
        # Counters: 1 embedding g + 2 per block (b×s×h) + 3 cross-entropy (b×s) forward; 2 per
        # block + 1 head f backward. all_reduce counts 2Ψ elements (ZeRO §7).
        assert fwd.calls == 1 + 2 * L + 3 and fwd.elements == 2 * ((1 + 2 * L) * bsh + 3 * bs), fwd
        assert bwd.calls - fwd.calls == 2 * L + 1, bwd
        assert bwd.elements - fwd.elements == 2 * (2 * L + 1) * bsh, bwd

    # One block alone: exactly 2 TP all-reduces forward and 2 backward.
    x = torch.randn(2, cfg.seq_length, cfg.hidden_size, requires_grad=True)
    mark = grid.stats.snapshot()
    y = model.blocks[0](x)
    assert grid.stats.since(mark).get("all_reduce", "tp").calls == 2
    y.sum().backward()
    assert grid.stats.since(mark).get("all_reduce", "tp").calls == 4
    assert grid.stats.since(mark).total(op="all_gather").calls == 0  # no logits gathered anywhere in the model
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_gpt_equals_single_process_reference(tp):
    assert all(spawn(check_tp_equals_reference, tp, tp, timeout=90))


def check_dropout_and_layouts():
    """Dropout streams and layout-independent init.

    TP=2 vs TP=1 with dropout is compared in float64 only, to ``FP64_TP_PP``: torch draws
    different dropout masks for fp32 and float64 tensors, so no float64 run is the truth of an
    fp32 dropout run, and which stream residual dropout uses does not depend on the precision.
    Init is compared bitwise: the same fp32 draws, only sliced differently.
    """
    import torch.distributed as dist

    g = torch.Generator().manual_seed(5)
    cfg = make_cfg(dropout=0.1, attention_dropout=0.1)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    grid2 = Grid(ParallelDims(tp=2))
    grid1 = Grid(ParallelDims(tp=1))

    def loss_of(model, seed=11):
        model.rng.seed(seed, model.grid)
        return model(ids, labels).detach()

    m2 = GPT(cfg, grid2, seed=21)
    a, b = loss_of(m2), loss_of(m2)
    assert_bitwise(a, b, "same seed, same masks, same loss")
    assert not torch.equal(loss_of(m2, seed=12), a)  # and the masks really are random
    m2.eval()
    assert not torch.equal(m2(ids, labels), a)  # eval disables dropout

    # TP=2 vs TP=1 with TP-region dropout off: hidden dropout draws from the shared stream.
    cfg_no_attn = make_cfg(dropout=0.1, attention_dropout=0.0)
    d2 = GPT(cfg_no_attn, grid2, seed=21, dtype=torch.float64)
    d1 = GPT(cfg_no_attn, grid1, seed=21, dtype=torch.float64)
    assert_fp64(loss_of(d2), loss_of(d1), FP64_TP_PP, "dropout loss, tp=2 vs tp=1")

    # Layout-independent init: the TP=2 shards gathered equal the TP=1 full tensors.
    t2 = GPT(cfg_no_attn, grid2, seed=21)
    t1 = GPT(cfg_no_attn, grid1, seed=21)
    for (name, p2), (_, p1) in zip(t2.named_parameters(), t1.named_parameters()):
        dim = shard_info(p2, name).tp_split_dim
        if dim is None:
            assert_bitwise(p2.detach(), p1.detach(), name)
            continue
        parts = [torch.empty_like(p2) for _ in range(2)]
        dist.all_gather(parts, p2.detach().contiguous(), group=grid2.tp_group.pg)
        full = torch.cat(parts, dim=dim)
        if name == "embedding.word.weight":  # padding depends on tp; it is zero, the real rows match
            assert not full[cfg.vocab_size:].any() and not p1[cfg.vocab_size:].any()
            full, p1 = full[: cfg.vocab_size], p1[: cfg.vocab_size]
        assert_bitwise(full, p1.detach(), name)

    # The speed option draws only the local slice: valid, but then layout-dependent.
    fast = GPT(cfg_no_attn, grid2, seed=21, layout_independent_init=False)
    assert not torch.equal(fast.blocks[0].mlp.fc1.weight, t2.blocks[0].mlp.fc1.weight)
    assert torch.equal(fast.embedding.position, t2.embedding.position)  # replicated: unchanged
    assert math.isfinite(loss_of(fast).item())
    return True


def test_dropout_reproducible_and_tp2_equals_tp1():
    assert all(spawn(check_dropout_and_layouts, 2, timeout=90))
