"""A checkpoint saved at CP 2 x DP 2 resumes at CP 1 x DP 4 and at CP 4, float64, 4 gloo ranks.

Reference: the CP 2 run itself, not interrupted (its losses equal the single process's: see
``test_context_parallel_parity`` and ``_training``). After 2 steps it saves (ZeRO-1: each rank's
partition over the data-parallel-with-CP group of 4); each other layout loads that checkpoint
(partitioned over 4 and 1 ranks: resharded) and runs steps 3-4 on the same global batches.
Their losses must equal the uninterrupted run's within 1e-12 relative (float64 round-off of a
different DP x CP reduction order); a load that dropped any partition moves them by ~1e-2.
"""

from __future__ import annotations

import torch

from tests.harness import spawn
from tests.zero.common import HYPER
from zerotron.model import GPT, GPTConfig
from zerotron.parallel import Grid, ParallelDims
from zerotron.parallel import collectives as C

STEPS, BATCH = 4, 4


def check_resume(tmp):
    from zerotron.checkpoint.checkpointer import Checkpointer, RunIdentity
    from zerotron.checkpoint.distributed import load_checkpoint
    from zerotron.config.run_config import CheckpointSection
    from zerotron.zero import ZeroConfig, ZeroOptimizer

    torch.set_num_threads(1)
    cfg = GPTConfig(num_layers=2, hidden_size=16, num_heads=2, vocab_size=64, seq_length=16,
                    dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8)
    g = torch.Generator().manual_seed(9)
    batches = [tuple(torch.randint(0, 64, (BATCH, 16), generator=g) for _ in range(2))
               for _ in range(STEPS)]

    def build(cp):
        grid = Grid(ParallelDims(cp=cp))
        model = GPT(cfg, grid, seed=3, dtype=torch.float64)
        opt = ZeroOptimizer(model, grid, ZeroConfig(stage=1), clip_grad=1.0, precision="fp64",
                            **HYPER)
        return grid, model, opt

    def train(grid, model, opt, steps):
        per = BATCH // grid.dp_size
        out = []
        for x, y in steps:
            mine = slice(grid.dp_rank * per, (grid.dp_rank + 1) * per)
            loss = model(x[mine], labels=y[mine])
            opt.backward(loss)
            opt.step()
            mean = C.all_reduce(loss.detach().reshape(1), grid.dp_cp_group)
            out.append(mean / grid.dp_cp_group.size)
        return torch.cat(out)

    grid, model, opt = build(2)
    train(grid, model, opt, batches[:2])
    saver = Checkpointer(CheckpointSection(save=str(tmp)), grid, opt.device, RunIdentity("cp"))
    saver.track(model, opt, {})
    path = saver.save(2, consumed_samples=2 * BATCH)
    want = train(grid, model, opt, batches[2:])
    errors = {}
    for cp in (1, 4):
        grid, model, opt = build(cp)
        load_checkpoint(str(path), model, opt, grid, model_config={}, log=lambda _: None)
        got = train(grid, model, opt, batches[2:])
        errors[cp] = ((got - want).abs().max() / want.abs().max()).item()
    return errors


def test_checkpoint_of_cp2_resumes_at_cp1_and_cp4(tmp_path):
    for errors in spawn(check_resume, 4, tmp_path, timeout=180):
        assert max(errors.values()) < 1e-12, errors
