"""Stage 3's prefetch window changes when a unit is gathered, not what it computes: a 5-block GPT on
2 gloo ranks trains 3 steps with no prefetch (the reference: every unit gathered just in time),
the default window (one unit), and windows of 2 and 4 units, with and without ``overlap_comm``;
losses and final parameters are equal bit for bit."""

import torch

from tests.harness import spawn
from zerotron.testing.zero_runs import train_gpt

SHAPE = dict(num_layers=5, hidden_size=32, num_heads=2, vocab_size=64, seq_length=16)
BLOCK = 12 * 32 * 32 + 13 * 32  # one block's elements (every parameter partitioned: threshold 0)


def check_windows_change_when_not_what():
    ref = train_gpt(dict(stage=3, stage3_prefetch_bucket_size=0), 3, want_params=True, shape=SHAPE)
    for extra in (dict(stage3_prefetch_bucket_size=None),
                  dict(stage3_prefetch_bucket_size=2 * BLOCK + 99),
                  dict(stage3_prefetch_bucket_size=4 * BLOCK + 99, overlap_comm=True)):
        run = train_gpt(dict(stage=3, **extra), 3, want_params=True, shape=SHAPE)
        assert run["losses"] == ref["losses"], extra
        for name, value in ref["params"].items():
            assert torch.equal(run["params"][name], value), (extra, name)


def test_windows_change_when_not_what():
    spawn(check_windows_change_when_not_what, 2, timeout=200)
