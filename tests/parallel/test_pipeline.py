"""Pipeline parallelism (1F1B and AFAB) against the non-pipelined single-process reference, fp32 gloo CPU.

Reference (every rank computes it): the whole GPT built with the same seed on a tp = pp = 1 view
(``GPT(cfg, Grid(ParallelDims()))``, so the same full weights), trained on the full global batch
(every micro-batch of every DP rank concatenated) with ``torch.optim.AdamW`` and
``clip_grad_norm_`` -- no pipeline, no ZeRO. Layouts: PP 2 (2 ranks), PP 4 (4 ranks), and
TP 2 x PP 2 x DP 2 (8 ranks) with ZeRO stages 1 and 2. After each of 3 steps: the loss on every
rank equals the reference, every parameter slice equals the reference (rtol 1e-5), and the tied
word embedding is bit-identical between the first and the last stage.
"""

import pytest
import torch
import torch.distributed as dist

from tests.harness import spawn
from zerotron.model import GPT, GPTConfig
from zerotron.model.stages import build_stage, pipeline_step, split_layers
from zerotron.parallel import Grid, ParallelDims
from zerotron.parallel.pipeline import microbatches_in_flight

TOL = dict(rtol=1e-5, atol=1e-6)
# eps 1e-4, not 1e-8: gradients agree with the reference to fp32 round-off (~1e-8 absolute, the
# reduction order differs), and Adam's first steps divide by |g| + eps, so an element with |g|
# near eps would turn that round-off into an update difference up to lr * 1e-8 / (4 eps). The key
# bias is such an element (softmax ignores it: its true gradient is 0). eps = 1e-4 bounds the
# amplification at 2.5e-7 while keeping Adam's behaviour for every gradient >> 1e-4.
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-4, weight_decay=0.1)
SEED, STEPS, MICRO = 7, 3, 2  # MICRO: sequences per micro-batch per DP rank


def make_cfg(num_layers):
    return GPTConfig(num_layers=num_layers, hidden_size=16, num_heads=2, vocab_size=60, seq_length=8,
                     make_vocab_size_divisible_by=8)  # padded vocab 64 for tp 1 and 2


def make_data(cfg, m, dp, seed=3):
    """STEPS global batches of m micro-batches, each of dp * MICRO sequences."""
    g = torch.Generator().manual_seed(seed)
    shape = (dp * MICRO, cfg.seq_length)
    return [[(torch.randint(0, cfg.vocab_size, shape, generator=g),
              torch.randint(0, cfg.vocab_size, shape, generator=g)) for _ in range(m)] for _ in range(STEPS)]


def reference(cfg, data, ref_grid, clip):
    model = GPT(cfg, ref_grid, seed=SEED)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2]},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            foreach=False, **HYPER)
    losses, states = [], []
    for mbs in data:
        loss = model(torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs]))
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        states.append({model.global_name(n): p.detach().clone() for n, p in model.named_parameters()})
    return losses, states


def check_tied(model, grid):
    """The first stage's word embedding and the last stage's copy are bit-identical."""
    group = grid.embedding_group
    if group is None or group.size == 1:
        return
    w = model.word_embedding_weight.detach().contiguous()
    both = [torch.empty_like(w) for _ in range(2)]
    dist.all_gather(both, w, group=group.pg)
    assert torch.equal(both[0], both[1]), "tied embedding copies diverged"


def train_pipeline(cfg, grid, data, schedule, zero_stage=0, layers=None, clip=1.0, recompute=False):
    """Build this rank's stage, run STEPS pipeline steps; returns (losses, params after each step)."""
    from zerotron.zero import ZeroConfig, ZeroOptimizer

    model = build_stage(cfg, grid, layers, seed=SEED)
    events = []  # "F" per stage forward, "B" per backward (first gradient of the stage's last block)
    model.register_forward_pre_hook(lambda *_: events.append("F"))
    model.blocks[-1].ln2.weight.register_post_accumulate_grad_hook(lambda _: events.append("B"))
    calls = [0]
    if recompute == "zerotron":  # ZeRO-R checkpointing with Pa and MD buffers sized for the schedule
        from zerotron.zero.activation_checkpoint import apply_activation_checkpointing
        from zerotron.zero.activation_config import ActivationCheckpointConfig
        ac = ActivationCheckpointConfig(checkpoint_activations=True, partition_activations=True,
                                        contiguous_memory_optimization=True)
        in_flight = microbatches_in_flight(schedule, grid.pp_size, grid.pp_rank, len(data[0]))
        apply_activation_checkpointing(model, grid, ac, microbatches_in_flight=in_flight)
        assert model.block_runner is not None
    elif recompute:  # torch checkpointing inside the stage: the schedule must not care
        for blk in model.blocks:
            def fwd(x, f=blk.forward):
                calls[0] += 1
                return f(x)
            blk.forward = lambda x, f=fwd: torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False)
    if zero_stage is None:  # plain torch AdamW, no DP (dp = 1 here), no clipping
        opt = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.ndim >= 2]},
                                 {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                                foreach=False, **HYPER)
    else:
        opt = ZeroOptimizer(model, grid, ZeroConfig(stage=zero_stage), clip_grad=clip, **HYPER)
    sl = slice(grid.dp_rank * MICRO, (grid.dp_rank + 1) * MICRO)
    losses, states = [], []
    for mbs in data:
        grid.stats.reset()
        out = pipeline_step(model, [(x[sl], y[sl]) for x, y in mbs], None if zero_stage is None else opt,
                            schedule=schedule)
        m = len(mbs)
        assert events == expected_order(schedule, grid, m), (schedule, events)
        events.clear()
        sends = grid.stats.get("send", "pp").calls
        assert sends == m * ((not grid.is_last_stage) + (not grid.is_first_stage)), sends
        opt.step()
        if zero_stage is None:
            opt.zero_grad(set_to_none=True)
        check_tied(model, grid)
        losses.append(out.loss.item())
        states.append({model.global_name(n): p.detach().clone() for n, p in model.named_parameters()})
    if recompute is True:
        assert calls[0] == 2 * STEPS * len(data[0]) * len(model.blocks), calls  # forward + recompute
    return model, losses, states


def expected_order(schedule, grid, m):
    """AFAB: m forwards then m backwards; 1F1B: pp - r - 1 warm-up forwards, F B pairs, drain."""
    if schedule == "afab":
        return ["F"] * m + ["B"] * m
    warmup = min(grid.pp_size - grid.pp_rank - 1, m)
    return ["F"] * warmup + ["F", "B"] * (m - warmup) + ["B"] * warmup


def compare(model, grid, losses, states, ref_losses, ref_states, what):
    for step, (loss, ref) in enumerate(zip(losses, ref_losses)):
        assert abs(loss - ref) <= 1e-5 * abs(ref), f"{what} step {step}: loss {loss} != reference {ref}"
    for step, (mine, ref) in enumerate(zip(states, ref_states)):
        for name, p in model.named_parameters():
            full = ref[model.global_name(name)]
            if p.tp_split_dim is not None:
                full = full.chunk(grid.tp_size, dim=p.tp_split_dim)[grid.tp_rank]
            torch.testing.assert_close(mine[model.global_name(name)], full, **TOL,
                                       msg=lambda s: f"{what} step {step} {name}: {s}")


def check_pp(pp, runs):
    """runs: (num_layers, schedule, m, zero_stage, layers_per_stage, clip, recompute) on PP = world."""
    grid = Grid(ParallelDims(tp=1, pp=pp))
    ref_grid = Grid(ParallelDims())  # tp = pp = 1: the whole model on every rank
    for num_layers, schedule, m, zero_stage, layers, clip, recompute in runs:
        cfg = make_cfg(num_layers)
        data = make_data(cfg, m, grid.dp_size)
        ref_losses, ref_states = reference(cfg, data, ref_grid, clip)
        model, losses, states = train_pipeline(cfg, grid, data, schedule, zero_stage, layers, clip, recompute)
        compare(model, grid, losses, states, ref_losses, ref_states, f"pp={pp} {schedule} m={m} zero={zero_stage}")
    return True


def test_pp2_1f1b_and_afab_equal_reference():
    runs = [(3, "1f1b", 4, 0, None, 1.0, False),       # uneven default split: 2, 1
            (3, "1f1b", 8, 1, [1, 2], 0.05, False),     # explicit split, clipping active, Pos
            (2, "afab", 4, 0, None, 1.0, False),
            (2, "afab", 8, None, None, None, False)]    # plain torch AdamW: no optimizer contract
    assert all(spawn(check_pp, 2, 2, runs, timeout=120))


def test_pp4_1f1b_and_afab_equal_reference():
    runs = [(4, "1f1b", 4, 0, None, 1.0, False),
            (5, "1f1b", 8, 2, None, 1.0, False),         # 2, 1, 1, 1; Pos+g, dp = 1
            (4, "afab", 8, 0, None, 1.0, False),
            (4, "1f1b", 4, 0, None, 1.0, True),          # with activation checkpointing
            (4, "1f1b", 2, 0, None, 1.0, False)]         # m < pp: stage 0 never reaches steady state
    assert all(spawn(check_pp, 4, 4, runs, timeout=120))


def check_3d():
    grid = Grid(ParallelDims(tp=2, pp=2, dp=2))
    ref_grid = Grid(ParallelDims())
    for num_layers, zero_stage, layers, schedule, ac in [(4, 1, None, "1f1b", False), (4, 2, None, "1f1b", False),
                                                          (3, 2, None, "1f1b", "zerotron"),  # + Pa, MD
                                                          (3, 1, [1, 2], "afab", False)]:
        cfg = make_cfg(num_layers)
        data = make_data(cfg, 4, grid.dp_size)
        ref_losses, ref_states = reference(cfg, data, ref_grid, 1.0)
        model, losses, states = train_pipeline(cfg, grid, data, schedule, zero_stage, layers, 1.0, ac)
        compare(model, grid, losses, states, ref_losses, ref_states, f"3d zero={zero_stage} layers={layers}")
    # Pos+g+p with pipelines is refused on every rank, before any p2p.
    from zerotron.zero import ZeroConfig, ZeroOptimizer
    cfg = make_cfg(2)
    model = build_stage(cfg, grid, seed=SEED)
    opt = ZeroOptimizer(model, grid, ZeroConfig(stage=3), **HYPER)
    data = make_data(cfg, 2, 2)[0]
    with pytest.raises(ValueError, match="zero.stage=3"):
        pipeline_step(model, data, opt)
    return True


def test_tp2_pp2_dp2_zero1_and_zero2_equal_reference():
    assert all(spawn(check_3d, 8, timeout=180))


def test_split_rule_and_errors():
    assert split_layers(10, 4) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]  # earlier stages take the extra
    assert split_layers(4, 2) == [[0, 1], [2, 3]]
    assert split_layers(5, 2, [1, 4]) == [[0], [1, 2, 3, 4]]
    with pytest.raises(ValueError, match="parallel.pp=5 exceeds model.num_layers=4"):
        split_layers(4, 5)
    with pytest.raises(ValueError, match="sums to 3"):
        split_layers(4, 2, [1, 2])
    with pytest.raises(ValueError, match="2 entries but parallel.pp=3"):
        split_layers(4, 3, [2, 2])
    with pytest.raises(ValueError, match="positive integer"):
        split_layers(4, 2, [0, 4])
