"""MD's ``number_checkpoints`` against the checkpoints a pipeline rank holds at once (ZeRO §6.3).

The contiguous buffer has ``number_checkpoints`` slots; a pipeline rank keeps the checkpoints of
every forward whose backward has not run yet (1F1B: pp - rank of them on rank ``rank``). A count
too small for the busiest rank must be refused on every rank before any collective: found in the
middle of a step it stops that one rank while its peers wait out the collective timeout. The
counts below are worked out by hand for 4 layers on pp = 2 (2 layers per rank), 4 micro-batches.
"""

import pytest
import torch

from tests.harness import spawn
from zerotron.model import GPTConfig
from zerotron.config.run_config import ConfigError, RunConfig

CFG = dict(num_layers=4, hidden_size=32, num_heads=4, vocab_size=90, seq_length=16, make_vocab_size_divisible_by=8)


def run_config(number_checkpoints, schedule="1f1b"):
    run = RunConfig()
    run.parallel.pp, run.parallel.pipeline_schedule = 2, schedule
    run.model.num_layers, run.model.hidden_size, run.model.num_heads = 4, 32, 4
    run.training.micro_batch_size, run.training.global_batch_size = 2, 8
    ac = run.activation_checkpointing
    ac.checkpoint_activations, ac.contiguous_memory_optimization, ac.number_checkpoints = True, True, number_checkpoints
    return run.validate(2)


def one_step(number_checkpoints):
    from zerotron.model.stages import pipeline_step
    from zerotron.parallel import Grid
    from zerotron.training.parallelize import parallelize_gpt

    run = run_config(number_checkpoints)
    grid = Grid(run.parallel)
    try:
        plan = parallelize_gpt(run, GPTConfig(**CFG), grid)
    except ValueError as e:
        return str(e)
    g = torch.Generator().manual_seed(1)
    mbs = [(torch.randint(0, 90, (2, 16), generator=g), torch.randint(0, 90, (2, 16), generator=g)) for _ in range(4)]
    pipeline_step(plan.model, mbs, plan.optimizer)
    return plan.activations.memory_report()["peak_checkpoints"]


def test_enough_slots_for_the_busiest_rank_run():
    # rank 0: 2 checkpoints per forward x 2 forwards in flight; rank 1: 2 x 1
    assert spawn(one_step, 2, 4, timeout=120) == [4, 2]


def test_too_few_slots_refused_on_every_rank_before_any_collective():
    # DeepSpeed's meaning of the key (checkpoints of one forward): 2, too few for rank 0's 4
    results = spawn(one_step, 2, 2, timeout=120)
    assert all("activation_checkpointing.number_checkpoints=2" in r and "4" in r for r in results), results


@pytest.mark.parametrize("schedule,need", [("1f1b", 4), ("afab", 8)])
def test_start_up_check_names_the_field_and_the_count(schedule, need):
    from zerotron.training.setup_run import validate_model

    with pytest.raises(ConfigError, match=f"activation_checkpointing.number_checkpoints={need - 1}: .*{need}"):
        validate_model(run_config(need - 1, schedule))
    validate_model(run_config(need, schedule))


def test_interleaved_unequal_chunks_are_not_refused_below_their_true_peak():
    """pp 2, v 2, 6 layers: chunks of 2, 2, 1, 1 layers. Rank 0's forwards in flight mix a 2-layer
    and a 1-layer chunk, so its peak is 9 checkpoints (measured), not 5 forwards x 2 = 10: the
    start-up check must not refuse 9. It still refuses what no mix of chunks can hold."""
    from zerotron.training.setup_run import validate_model

    run = run_config(9)
    run.parallel.virtual_stages, run.model.num_layers = 2, 6
    run.validate(2)
    validate_model(run)
    run.activation_checkpointing.number_checkpoints = 4
    with pytest.raises(ConfigError, match="number_checkpoints=4: .*at least 5"):
        validate_model(run)
