"""``training.step.eval_step``: the evaluation beside ``run_step``, forward only.

Reference (every rank computes it): the whole GPT built with the same seed on a tp = pp = 1 view
(as ``tests/parallel/test_pipeline.py``), its loss on each micro-batch under ``no_grad``, averaged.
float64 tier: a pipeline of two stages (the schedule's forward order, activations sent between
ranks) and the unpipelined path both within ``FP64_TP_PP`` of it, the same on every stage. bf16:
the optimizer casts the stage's parameters to 16-bit in place, so the activations sent between
stages must follow (``model.stages.stage_wire``, shared with ``pipeline_step``); a wire of the
wrong dtype fails the stage's first matmul.
"""

import torch
import torch.distributed as dist

from tests.harness import spawn
from tests.parity import FP64_TP_PP, assert_fp64
from zerotron.model import GPT, GPTConfig
from zerotron.model.stages import build_stage
from zerotron.parallel import Grid, ParallelDims
from zerotron.training.step import eval_step

SEED, MICRO, M = 5, 2, 3  # M micro-batches of MICRO sequences


def _cfg():
    return GPTConfig(num_layers=2, hidden_size=16, num_heads=2, vocab_size=60, seq_length=8,
                     make_vocab_size_divisible_by=8)


def _batches(cfg):
    g = torch.Generator().manual_seed(11)
    shape = (MICRO, cfg.seq_length)
    return [(torch.randint(0, cfg.vocab_size, shape, generator=g),
             torch.randint(0, cfg.vocab_size, shape, generator=g)) for _ in range(M)]


def _check():
    from zerotron.zero import ZeroConfig, ZeroOptimizer

    torch.set_num_threads(1)
    cfg, grid, whole_grid = _cfg(), Grid(ParallelDims(pp=2)), Grid(ParallelDims())
    batches = _batches(cfg)
    whole = GPT(cfg, whole_grid, seed=SEED, dtype=torch.float64)
    with torch.no_grad():
        truth = torch.stack([whole(x, labels=y) for x, y in batches]).mean()
    assert_fp64(eval_step(whole, batches, whole_grid), truth, FP64_TP_PP, "eval_step without a pipeline")
    stage = build_stage(cfg, grid, seed=SEED, dtype=torch.float64)
    piped = eval_step(stage, batches, grid)
    assert_fp64(piped, truth, FP64_TP_PP, f"eval_step on pipeline stage {grid.pp_rank}")
    stage16 = build_stage(cfg, grid, seed=SEED)
    ZeroOptimizer(stage16, grid, ZeroConfig(stage=1), precision="bf16")  # casts in place
    assert next(stage16.parameters()).dtype == torch.bfloat16
    loss16 = eval_step(stage16, batches, grid)
    both = [torch.empty(2, dtype=torch.float64) for _ in range(2)]
    dist.all_gather(both, torch.stack([piped, loss16]), group=grid.pp_group.pg)
    assert torch.equal(both[0], both[1]), f"stages disagree on the loss: {both}"
    return float(loss16), float(truth)


def test_eval_step_matches_the_unpipelined_model():
    for bf16, truth in spawn(_check, 2, timeout=120):
        assert abs(bf16 - truth) < 0.05 * truth, (bf16, truth)  # a smoke check: the bf16 wire ran
