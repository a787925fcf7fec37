"""Context parallelism's sequence layout and start-up checks (no process group).

Reference: chunks i and 2*cp-1-i written out by hand for cp = 2 and 4, and the whole-sequence
positions they must carry.
"""

import pytest
import torch

from zerotron.parallel.context_parallel import local_chunks, local_positions
from zerotron.config.run_config import ConfigError, RunConfig
from zerotron.training.setup_run import validate_model


def test_each_rank_holds_chunks_i_and_its_mirror():
    s = 16
    ids = torch.arange(s).unsqueeze(0)
    # cp = 2: chunks of 4 -> rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert local_chunks(ids, 0, 2).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert local_chunks(ids, 1, 2).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    # cp = 4: chunks of 2 -> rank r holds chunks r and 7 - r
    want = {0: [0, 1, 14, 15], 1: [2, 3, 12, 13], 2: [4, 5, 10, 11], 3: [6, 7, 8, 9]}
    for r, w in want.items():
        assert local_chunks(ids, r, 4).tolist() == [w]
        assert local_positions(s, r, 4).tolist() == w  # global positions of the held tokens
    every = torch.cat([local_chunks(ids, r, 4) for r in range(4)], dim=1)
    assert sorted(every[0].tolist()) == list(range(s))  # every token held once


def _cfg(**parallel):
    cfg = RunConfig()
    cfg.model.preset, cfg.model.seq_length = "tiny", 30
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


@pytest.mark.parametrize("parallel,world,needle", [
    (dict(cp=2), 2, "model.seq_length=30 is not divisible by 2*parallel.cp=4"),
    (dict(cp=4), 4, "model.seq_length=30 is not divisible by 2*parallel.cp=8"),
])
def test_bad_sequence_length_for_cp_is_named(parallel, world, needle):
    cfg = _cfg(**parallel).validate(world)
    with pytest.raises(ConfigError, match=needle.replace("*", r"\*")):
        validate_model(cfg)


def test_sequence_parallel_needs_each_ranks_tokens_divisible_by_tp():
    cfg = _cfg(cp=2, tp=4, sequence_parallel=True)
    cfg.model.seq_length = 36  # 18 tokens per CP rank, not divisible by tp = 4
    cfg.validate(8)
    with pytest.raises(ConfigError, match="each CP rank's 18 tokens are split over parallel.tp=4"):
        validate_model(cfg)


@pytest.mark.parametrize("zero,needle", [
    (dict(zero_hpz_partition_size=2), "zero.zero_hpz_partition_size=2 with parallel.cp=2"),
    (dict(zero_quantized_gradients=True), "zero.zero_quantized_gradients=True with parallel.cp=2"),
])
def test_zeropp_node_groups_refused_under_cp(zero, needle):
    cfg = _cfg(cp=2)
    cfg.zero.stage = 3
    for k, v in zero.items():
        setattr(cfg.zero, k, v)
    with pytest.raises(ConfigError, match=needle):
        cfg.validate(4)
