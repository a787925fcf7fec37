"""PretrainSampler: the global batch at c consumed samples is [c, c+G) whatever the DP size;
resuming at consumed = kG gives the same next batches as not stopping, and a resume with another
global batch size continues from the checkpoint's count, multiple of the new size or not."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerotron.data import PretrainSampler


def _global_batches(total, consumed, mbs, gbs, dp):
    """Per step: the sorted union over DP ranks and micro-steps (what the gradient averages)."""
    ranks = [list(PretrainSampler(total, consumed, mbs, gbs, r, dp)) for r in range(dp)]
    micro = gbs // (mbs * dp)
    steps = len(ranks[0]) // micro
    assert all(len(r) == len(ranks[0]) for r in ranks)
    return [sorted(i for r in ranks for mb in r[s * micro:(s + 1) * micro] for i in mb)
            for s in range(steps)]


@settings(max_examples=40, deadline=None)
@given(mbs=st.integers(1, 4), micro=st.integers(1, 4), steps=st.integers(1, 6),
       extra=st.integers(0, 7), resume=st.integers(0, 6))
def test_dp_invariant_and_resumable(mbs, micro, steps, extra, resume):
    gbs = mbs * 4 * micro  # divisible by dp in {1, 2, 4}
    total = gbs * steps + extra % gbs  # a partial last global batch is never used
    ref = _global_batches(total, 0, mbs, gbs, 1)
    assert ref == [list(range(k * gbs, (k + 1) * gbs)) for k in range(steps)]
    for dp in (2, 4):
        assert _global_batches(total, 0, mbs, gbs, dp) == ref
    k = min(resume, steps)
    for dp in (1, 4):
        assert _global_batches(total, k * gbs, mbs, gbs, dp) == ref[k:]
    for r in range(4):  # the resumed stream is the tail of the uninterrupted one, rank by rank
        full = list(PretrainSampler(total, 0, mbs, gbs, r, 4))
        assert list(PretrainSampler(total, k * gbs, mbs, gbs, r, 4)) == full[k * micro:]


def test_micro_batches_and_len():
    s = PretrainSampler(100, 16, 2, 16, 1, 2)
    batches = list(s)
    assert s.num_micro_batches == 4 and len(s) == len(batches) == 5 * 4
    assert batches[0] == [24, 25] and all(len(b) == 2 for b in batches)


@pytest.mark.parametrize("old_gbs,new_gbs,steps", [(4, 12, 4), (8, 4, 4), (12, 8, 1)])
def test_resume_with_another_global_batch_continues_at_the_consumed_count(old_gbs, new_gbs, steps):
    consumed = old_gbs * steps  # what the checkpoint stores; 16 is not a multiple of 12
    total = consumed + 3 * new_gbs
    for dp in (1, 2):
        assert _global_batches(total, consumed, 2, new_gbs, dp) == [
            list(range(consumed + k * new_gbs, consumed + (k + 1) * new_gbs)) for k in range(3)]


@pytest.mark.parametrize("kwargs,msg", [
    (dict(global_batch_size=10), "multiple of micro_batch_size x dp_size"),
    (dict(consumed_samples=-1), "consumed_samples must be >= 0"),
    (dict(consumed_samples=200), "exceeds total_samples"),
    (dict(dp_rank=2), "dp_rank 2 is not in"),
    (dict(micro_batch_size=0), "micro_batch_size must be positive"),
])
def test_bad_arguments(kwargs, msg):
    args = dict(total_samples=100, consumed_samples=0, micro_batch_size=2, global_batch_size=8,
                dp_rank=0, dp_size=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=msg):
        PretrainSampler(**args)
