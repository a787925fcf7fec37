"""``training.compile``: each block's forward through torch.compile (inductor, on this CPU)
trains as the eager model does -- float64 tier, losses and final parameters of 3 steps within
1e-10 (``FP64_ZERO``'s 1e-9 tightened: the only difference is inductor's order of sums) -- and
the compiled path really ran (dynamo produced graphs); stage 3's gather/release hooks and
activation checkpointing's recompute run around and through it. With TP 2 and dropout the
masks are inductor's own, so that test checks what must hold under any RNG: the recompute
replays the forward's masks, and the TP-replicated parameters stay equal across TP ranks."""

from tests.harness import spawn
from tests.parity import assert_fp64

STEPS = 3
LAYOUTS = ((0, False), (3, True))  # (ZeRO stage, activation checkpointing)


def train(compiled: bool, stage: int, checkpointing: bool, tp: int = 1, dropout: float = 0.0, steps: int = STEPS,
          fresh: bool = True):
    """fp64, micro-batch 2 of 16 tokens, on ``tp`` ranks; ``dropout`` in every place the block has
    one. Returns the losses, the full parameters and dynamo's count of graphs. ``fresh=False``
    keeps dynamo's cache: blocks of the same shape reuse the graphs already compiled."""
    import torch

    from zerotron.model.config import GPTConfig
    from zerotron.parallel import Grid
    from zerotron.config.run_config import RunConfig
    from zerotron.training.parallelize import parallelize_gpt

    if fresh:
        torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cfg = RunConfig()
    cfg.parallel.tp = tp
    t = cfg.training
    t.precision, t.micro_batch_size, t.global_batch_size, t.compile = "fp64", 2, 2, compiled
    cfg.activation_checkpointing.checkpoint_activations = checkpointing
    cfg.zero.stage = stage
    model_cfg = GPTConfig(num_layers=2, hidden_size=32, num_heads=4, vocab_size=128, seq_length=16,
                          dropout=dropout, attention_dropout=dropout)
    grid = Grid(cfg.parallel)
    plan = parallelize_gpt(cfg.validate(tp), model_cfg, grid)
    model, opt = plan.model, plan.optimizer
    gen = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 128, (2, 16), generator=gen)
        loss = model(ids, ids)
        opt.backward(loss)
        opt.step()
        losses.append(loss.detach())
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return torch.stack(losses), dict(opt.full_params()), graphs


def use_inductor(cache: str) -> None:
    """The test's own inductor cache: kernels another process compiled for another CPU capability
    (ATEN_CPU_CAPABILITY) must not be reused here. Scalar C++ kernels, not vectorised ones: what
    is under test is how the blocks are compiled into training (hooks, recompute, RNG), not
    inductor's CPU code generation, which a GPU run never uses; they compile in about 60 % of
    the time and compute the same float64 results to the tolerance below."""
    import os

    import torch._inductor.config

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    torch._inductor.config.cpp.vec_isa_ok = False


def check(cache: str):
    """Both layouts in one process: the second reuses the first's kernels (the block's arithmetic
    is the same), which halves the test's compile time on a 2-core machine."""
    use_inductor(cache)
    for stage, checkpointing in LAYOUTS:
        eager_losses, eager_params, eager_graphs = train(False, stage, checkpointing)
        losses, params, graphs = train(True, stage, checkpointing)
        where = f"stage {stage}, checkpointing {checkpointing}"
        assert eager_graphs == 0 and graphs >= 1, (where, eager_graphs, graphs)
        assert_fp64(losses, eager_losses, 1e-10, f"losses ({where})")
        for name, value in params.items():
            assert_fp64(value, eager_params[name], 1e-10, f"{name} ({where})")
    return True


def test_compiled_blocks_train_as_eager(tmp_path):
    assert all(spawn(check, 1, str(tmp_path / "inductor"), timeout=300))


def train_tp_dropout(compiled: bool, checkpointing: bool, fresh: bool = True):
    """TP 2, dropout 0.1, 2 steps; returns the losses and the LayerNorm parameters (replicated
    over TP: every TP rank must hold the same ones)."""
    losses, params, _ = train(compiled, 0, checkpointing, tp=2, dropout=0.1, steps=2, fresh=fresh)
    norms = {k: v for k, v in params.items() if ".ln" in k or k.startswith("final_ln")}
    assert norms, "no LayerNorm parameter matched: the checks below would compare nothing"
    return losses, norms


def check_tp_dropout(cache: str):
    import torch

    use_inductor(cache)
    eager = train_tp_dropout(False, True)
    recomputed = train_tp_dropout(True, True)
    kept = train_tp_dropout(True, False, fresh=False)  # the recompute's training graphs serve it
    # inductor draws its own masks (not eager's: its RNG is its own), and the recompute of a
    # checkpointed block must replay them exactly, or its gradients belong to another mask
    assert not torch.equal(recomputed[0], eager[0]), "compiled dropout drew eager's masks: the test checks nothing"
    assert torch.equal(recomputed[0], kept[0]), (recomputed[0], kept[0])
    for name, value in recomputed[1].items():
        assert torch.equal(value, kept[1][name]), name
    return recomputed[1]


def test_compiled_tp_blocks_with_dropout(tmp_path):
    """TP 2 with dropout on, compiled blocks under inductor's own RNG: activation checkpointing's
    recompute replays the forward's masks bit for bit (checkpointed and kept activations train
    identically), and the TP-replicated LayerNorms stay identical across TP ranks, so the
    residual dropout drew one mask for the whole TP group and attention dropout its per-rank one
    without splitting the replicated stream."""
    norms = spawn(check_tp_dropout, 2, str(tmp_path / "inductor"), timeout=400)
    for name, value in norms[0].items():
        assert (value == norms[1][name]).all(), f"{name} differs across TP ranks"
