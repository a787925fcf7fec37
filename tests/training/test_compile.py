"""``training.compile``: each block's forward through torch.compile (inductor, on this CPU)
trains as the eager model does -- float64 tier, losses and final parameters of 3 steps within
1e-10 (``FP64_ZERO``'s 1e-9 tightened: the only difference is inductor's order of sums) -- and
the compiled path really ran (dynamo produced graphs); stage 3's gather/release hooks and
activation checkpointing's recompute run around and through it."""

from tests.harness import spawn
from tests.parity import assert_fp64

STEPS = 3
LAYOUTS = ((0, False), (3, True))  # (ZeRO stage, activation checkpointing)


def train(compiled: bool, stage: int, checkpointing: bool):
    import torch

    from zerotron.model.config import GPTConfig
    from zerotron.parallel import Grid, ParallelDims
    from zerotron.training.config import RunConfig
    from zerotron.training.parallelize import parallelize_gpt

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    grid = Grid(ParallelDims())
    cfg = RunConfig()
    t = cfg.training
    t.precision, t.micro_batch_size, t.global_batch_size, t.compile = "fp64", 2, 2, compiled
    cfg.activation_checkpointing.checkpoint_activations = checkpointing
    cfg.zero.stage = stage
    model_cfg = GPTConfig(num_layers=2, hidden_size=32, num_heads=4, vocab_size=128, seq_length=16,
                          dropout=0.0, attention_dropout=0.0)
    plan = parallelize_gpt(cfg.validate(1), model_cfg, grid)
    model, opt = plan.model, plan.optimizer
    gen = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, 128, (2, 16), generator=gen)
        loss = model(ids, ids)
        opt.backward(loss)
        opt.step()
        losses.append(loss.detach())
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return torch.stack(losses), dict(opt.full_params()), graphs


def check(cache: str):
    """Both layouts in one process: the second reuses the first's kernels (the block's arithmetic
    is the same), which halves the test's compile time on a 2-core machine."""
    import os

    # the test's own inductor cache: kernels another process compiled for another CPU capability
    # (ATEN_CPU_CAPABILITY) must not be reused here
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
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
