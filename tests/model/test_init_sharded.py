"""Sharded initialisation: the whole-tensor values, but only a shard and one chunk in memory.

``init_sharded_`` gives each TP rank its slice of one full N(0, std²) tensor drawn from a
per-name seed, so every (tp, pp) layout starts from the same weights. It draws that tensor a
bounded chunk at a time. Two claims are checked here, each against an independent reference:

* **values**: bit for bit (int32 views, so -0.0 and NaN payloads count) what drawing the whole
  tensor with ``torch.randn`` and slicing it gives -- the reference is that whole draw, written
  out below -- for TP 1/2/4, both pipeline stages of PP 2, the padded vocabulary, the
  layout-dependent option and odd sizes that end chunks mid-row and mid-block of 16;
* **memory**: the live tensor storages while a GPT is built, tracked by torch's ``MemTracker``
  (a dispatch mode that sees every allocation and, by weak references, every free), peak at
  most the parameters it ends with plus one chunk: never the full tensor of a split weight.

Layouts use a stand-in grid with just the fields construction reads, so TP 2 and PP 2 ranks are
built in this one process without process groups; ``tests/parallel/test_tp_gpt.py`` gathers
real TP 2 shards against TP 1.
"""
import random
import types

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

import zerotron.model.gpt as gpt_module
from zerotron.model import GPTConfig
from zerotron.model.stages import build_stage
from zerotron.parallel import tensor_parallel as tp_mod
from zerotron.parallel.shard_info import shard_info
from zerotron.parallel.tensor_parallel import draw_shard_, init_sharded_, tensor_seed

SMALL_CHUNK = 4096  # bytes: forces many chunks, tails and partial rows in a small model


def stand_in_grid(tp: int = 1, tp_rank: int = 0, pp: int = 1, pp_rank: int = 0):
    """The grid fields building a stage reads; no process group is ever used while building."""
    return types.SimpleNamespace(tp_size=tp, tp_rank=tp_rank, pp_size=pp, pp_rank=pp_rank, tp_group=None,
                                 cp_size=1, cp_rank=0,
                                 is_first_stage=pp_rank == 0, is_last_stage=pp_rank == pp - 1)


def config(**kw) -> GPTConfig:
    base = dict(num_layers=3, hidden_size=40, num_heads=4, vocab_size=1001, seq_length=8,
                make_vocab_size_divisible_by=8)
    base.update(kw)
    return GPTConfig(**base)


def whole_draw(full_shape, split, tp_rank, tp_size, std, gen_seed, valid_rows=None) -> torch.Tensor:
    """The reference: draw the full tensor in one ``randn`` and keep this rank's slice."""
    g = torch.Generator().manual_seed(gen_seed)
    if valid_rows is None:
        full = torch.randn(list(full_shape), generator=g, dtype=torch.float32) * std
    else:
        full = torch.zeros(list(full_shape), dtype=torch.float32)
        full[:valid_rows] = torch.randn([valid_rows, *full_shape[1:]], generator=g) * std
    return full if split is None else full.chunk(tp_size, dim=split)[tp_rank]


@torch.no_grad()
def whole_draw_init_(param, std, seed, name, tp_rank, tp_size, layout_independent=True, valid_rows=None, out=None):
    """``init_sharded_`` by the whole draw: the same naming and seeds, the reference's values."""
    out = param if out is None else out
    split = shard_info(param, name).tp_split_dim
    if split is None or tp_size == 1 or layout_independent:
        local = whole_draw(shard_info(param, name).global_shape, split, tp_rank, tp_size, std,
                           tensor_seed(seed, name), valid_rows)
    else:
        mine = None if valid_rows is None or split != 0 else min(max(valid_rows - tp_rank * param.shape[0], 0),
                                                                   param.shape[0])
        local = whole_draw(param.shape, None, 0, 1, std, tensor_seed(seed, f"{name}/tp{tp_rank}of{tp_size}"), mine)
    out.copy_(local)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    bits = {torch.float32: torch.int32, torch.float64: torch.int64}[got.dtype]
    assert torch.equal(got.contiguous().view(bits), want.contiguous().view(bits)), f"{what}: not bit-identical"


def test_chunk_boundaries_reproduce_one_draw():
    """The property the method rests on, on this machine's kernels: chunked ``normal_`` draws
    (multiples of 16, the last at least 16) equal one draw and leave the generator where it does."""
    rnd = random.Random(7)
    for numel in [1, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65, 1000, 4099] + [rnd.randrange(16, 30000) for _ in range(20)]:
        for step in (32, 48, 1024):
            ends = [e for _, e in tp_mod._stream_chunks(numel, step)]
            sizes = [b - a for a, b in zip([0] + ends, ends)]
            assert ends[-1] == numel and all(0 < s <= step for s in sizes), (numel, step, sizes)
            assert all(s % 16 == 0 for s in sizes[:-1]) and (sizes[-1] >= 16 or len(sizes) == 1), (numel, step)
            g_whole, g_parts = torch.Generator().manual_seed(numel), torch.Generator().manual_seed(numel)
            whole = torch.randn(numel, generator=g_whole)
            parts = torch.cat([torch.empty(s).normal_(0.0, 1.0, generator=g_parts) for s in sizes])
            assert_same_bits(parts, whole, f"numel={numel} step={step}")
            assert torch.equal(g_parts.get_state(), g_whole.get_state())


def test_draw_shard_equals_the_whole_draw_sliced():
    rnd = random.Random(3)
    cases = [((96, 40), 0), ((40, 96), 1), ((7, 9, 13), 1), ((5, 33), 1), ((33,), 0), ((8, 5, 6), 2),
             ((17, 3), None), ((3, 5), None), ((2, 3), 0)]
    for _ in range(40):
        nd = rnd.choice([1, 2, 3])
        shape = [rnd.randrange(1, 30) for _ in range(nd)]
        cases.append((tuple(shape), rnd.choice([None, *range(nd)])))
    for shape, split in cases:
        for tp in (1, 2, 4):
            full = list(shape)
            if split is not None:
                full[split] *= tp
            for valid_rows in (None, full[0] // 2 + 1):
                seed = rnd.randrange(1 << 63)
                for rank in range(tp if split is not None else 1):
                    want = whole_draw(full, split, rank, tp, 0.02, seed, valid_rows)
                    for chunk in (4, 132, 1000, SMALL_CHUNK, 1 << 26):
                        got = torch.full(want.shape, float("nan"))
                        draw_shard_(got, full, split, rank, tp, 0.02, seed, valid_rows, chunk_bytes=chunk)
                        assert_same_bits(got, want, f"{full} split={split} rank {rank}/{tp} rows={valid_rows} "
                                                    f"chunk={chunk}")


LAYOUTS = [(1, 0, 1, 0), (2, 0, 1, 0), (2, 1, 1, 0), (4, 3, 1, 0), (1, 0, 2, 0), (1, 0, 2, 1), (2, 1, 2, 1)]


@pytest.mark.parametrize("chunk", [SMALL_CHUNK, None])
@pytest.mark.parametrize("tp,tp_rank,pp,pp_rank", LAYOUTS)
def test_gpt_weights_are_the_whole_draw_for_every_layout(monkeypatch, tp, tp_rank, pp, pp_rank, chunk):
    if chunk is not None:
        monkeypatch.setattr(tp_mod, "INIT_CHUNK_BYTES", chunk)
    cfg, grid = config(), stand_in_grid(tp, tp_rank, pp, pp_rank)
    built = build_stage(cfg, grid, seed=5)
    fast = build_stage(cfg, grid, seed=5, layout_independent_init=False)
    monkeypatch.setattr(gpt_module, "init_sharded_", whole_draw_init_)
    reference = build_stage(cfg, grid, seed=5)
    reference_fast = build_stage(cfg, grid, seed=5, layout_independent_init=False)
    for (name, p), (_, want), (_, f), (_, want_f) in zip(built.named_parameters(), reference.named_parameters(),
                                                          fast.named_parameters(), reference_fast.named_parameters()):
        assert_same_bits(p.detach(), want.detach(), name)
        assert_same_bits(f.detach(), want_f.detach(), f"{name} (layout-dependent)")


@pytest.mark.parametrize("layout_independent", [True, False])
@pytest.mark.parametrize("tp,tp_rank,pp,pp_rank", [(2, 1, 1, 0), (4, 2, 1, 0), (4, 3, 2, 1)])
def test_padding_rows_of_the_vocabulary_start_at_zero(tp, tp_rank, pp, pp_rank, layout_independent):
    """Padding rows never enter a loss (their logits are masked), so only their initial values ever
    sit there: zero in both init modes, as ``GPT.init_parameter_`` promises, and the real rows drawn."""
    cfg, grid = config(vocab_size=33), stand_in_grid(tp, tp_rank, pp, pp_rank)
    model = build_stage(cfg, grid, seed=5, layout_independent_init=layout_independent)
    w = model.word_embedding_weight.detach()
    real = min(max(cfg.vocab_size - tp_rank * w.shape[0], 0), w.shape[0])
    assert not w[real:].any(), f"padding rows {tp_rank * w.shape[0] + real}.. are not zero"
    assert w[:real].abs().min() > 0 if real else True


def test_one_parameter_drawn_again_alone_even_from_a_shape_only_model():
    """``GPT.init_parameter_``: the values ``init_weights`` gives, into any tensor, one parameter at a
    time -- a 16-bit or meta model's fp32 masters can come from the unrounded values."""
    cfg, grid = config(), stand_in_grid(2, 1, 2, 1)
    fp32 = build_stage(cfg, grid, seed=9)
    meta = build_stage(cfg, grid, seed=9, device="meta")
    bf16 = build_stage(cfg, grid, seed=9, dtype=torch.bfloat16)
    for (name, p), (_, m), (_, h) in zip(fp32.named_parameters(), meta.named_parameters(), bf16.named_parameters()):
        assert m.is_meta
        out = torch.empty(m.shape)
        meta.init_parameter_(name, out)
        assert_same_bits(out, p.detach(), name)
        assert torch.equal(h.detach(), p.detach().to(torch.bfloat16)), f"{name}: bf16 build is the rounded fp32"
    with pytest.raises(ValueError, match="shape"):
        init_sharded_(fp32.blocks[0].mlp.fc1.weight, 0.02, 9, "x", 1, 2, out=torch.empty(3, 3))


def construction_peak(build):
    """(peak live bytes while ``build()`` runs, live bytes it leaves, its result), CPU storages."""
    tracker = MemTracker()
    with tracker:
        model = build()
        left = tracker.get_tracker_snapshot("current")
    peak = tracker.get_tracker_snapshot("peak")
    cpu = torch.device("cpu")
    return peak[cpu]["Total"], left[cpu]["Total"], model


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


RNG_STATE_SLACK = 64 << 10  # the per-rank dropout stream's saved generator state, kept by the model


@pytest.mark.parametrize("tp,tp_rank,pp,pp_rank", [(1, 0, 1, 0), (2, 1, 1, 0), (4, 0, 2, 1)])
def test_construction_peak_is_the_shards_plus_one_chunk(monkeypatch, tp, tp_rank, pp, pp_rank):
    monkeypatch.setattr(tp_mod, "INIT_CHUNK_BYTES", SMALL_CHUNK, raising=False)
    cfg = config(vocab_size=4001, hidden_size=64, num_layers=2)
    grid = stand_in_grid(tp, tp_rank, pp, pp_rank)
    peak, left, model = construction_peak(lambda: build_stage(cfg, grid, seed=1))
    shards = param_bytes(model)
    assert shards <= left <= shards + RNG_STATE_SLACK
    full_embedding = cfg.padded_vocab_size(tp) * cfg.hidden_size * 4
    assert full_embedding > 10 * SMALL_CHUNK  # the test means something: the largest weight is many chunks
    assert peak - left <= SMALL_CHUNK, (f"construction peak {peak} B = {left} B of parameters + "
                                        f"{peak - left} B of temporaries > one {SMALL_CHUNK} B chunk "
                                        f"(the full word embedding is {full_embedding} B)")


def test_construction_peak_at_the_default_chunk():
    """A word embedding bigger than the 64 MiB chunk, split over TP 2: only half of it is held,
    and at most one chunk beside it."""
    chunk = getattr(tp_mod, "INIT_CHUNK_BYTES", 64 << 20)
    cfg = config(vocab_size=50257, hidden_size=384, num_heads=6, num_layers=1, make_vocab_size_divisible_by=128)
    full_embedding = cfg.padded_vocab_size(2) * cfg.hidden_size * 4
    assert full_embedding > chunk
    for rank in (0, 1):
        peak, left, model = construction_peak(lambda: build_stage(cfg, stand_in_grid(2, rank), seed=1))
        assert left <= param_bytes(model) + RNG_STATE_SLACK
        assert peak - left <= chunk, (f"tp rank {rank}: construction peak {peak} B = {left} B kept + "
                                      f"{peak - left} B of temporaries > one {chunk} B chunk")
