"""The read-ahead loader serves exactly the sampler's batches, whatever position is asked for.

Reference: the sampler's indices stacked by hand, as the trainer did before read-ahead
(``np.stack`` of the samples, int64, inputs ``[:, :-1]`` and labels ``[:, 1:]``), compared bitwise.
"""

import threading

import numpy as np
import pytest
import torch

from zerotron.data import PretrainSampler
from zerotron.training.batches import BatchLoader

SEQ, MICRO, GLOBAL, DP = 6, 2, 8, 2  # 2 micro-batches per DP rank per step


class Samples:
    """``n`` samples of SEQ + 1 tokens; remembers which thread read each one; ``bad`` raise."""

    def __init__(self, n: int, bad=()):
        self.n, self.bad, self.readers = n, set(bad), {}

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.readers[i] = threading.current_thread().name
        if i in self.bad:
            raise OSError(f"sample {i}: short read")
        return (np.arange(SEQ + 1) * 7 + i * 13) % 50


def reference(ds, consumed, dp_rank):
    it = iter(PretrainSampler(len(ds), consumed, MICRO, GLOBAL, dp_rank, DP))
    out = []
    for _ in range(GLOBAL // (MICRO * DP)):
        tokens = torch.from_numpy(np.stack([ds[i] for i in next(it)]).astype(np.int64))
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def loader(ds, dp_rank=1, depth=2):
    return BatchLoader(ds, MICRO, GLOBAL, GLOBAL // (MICRO * DP), dp_rank, DP, torch.device("cpu"), depth=depth)


@pytest.mark.parametrize("depth", [0, 2])
def test_batches_are_the_samplers_in_any_order(depth):
    ds = Samples(6 * GLOBAL)
    got = loader(ds, depth=depth)
    # in order, then a resume further on, then a rewind (evaluation starts over), then the last step
    for consumed in (0, GLOBAL, 2 * GLOBAL, 4 * GLOBAL, GLOBAL, 5 * GLOBAL):
        batches = got.get(consumed)
        want = reference(ds, consumed, dp_rank=1)
        assert len(batches) == len(want)
        for (x, y), (wx, wy) in zip(batches, want):
            assert x.dtype == torch.int64 and torch.equal(x, wx) and torch.equal(y, wy)
    got.close()
    assert torch.equal(got.get(3 * GLOBAL)[0][0], reference(ds, 3 * GLOBAL, 1)[0][0])  # after close: inline


def test_the_next_steps_are_read_in_the_background():
    ds = Samples(6 * GLOBAL)
    got = loader(ds, dp_rank=0)
    got.get(0)
    for fut in list(got._pending.values()):
        fut.result(timeout=10)
    mine = {i for ix in got.indices(GLOBAL) + got.indices(2 * GLOBAL) for i in ix}
    assert {ds.readers[i] for i in mine} == {"zerotron-batches"}
    main = threading.current_thread().name
    ds.readers.clear()
    got.get(GLOBAL)
    assert main not in ds.readers.values()  # the step took what was read ahead
    got.close()


def test_a_read_error_stops_the_step_that_needs_it():
    ds = Samples(4 * GLOBAL, bad={2 * GLOBAL + 1})  # a sample of step 3, DP rank 0
    got = loader(ds, dp_rank=0)
    got.get(0)
    got.get(GLOBAL)  # step 3's failed read ahead is not this step's error
    with pytest.raises(OSError, match="short read"):
        got.get(2 * GLOBAL)
    got.close()


@pytest.mark.parametrize("bad", [-1, True, 1.5])
def test_a_bad_prefetch_is_refused_naming_the_field(bad):
    from zerotron.config.run_config import ConfigError, RunConfig

    cfg = RunConfig()
    cfg.data.prefetch = bad
    with pytest.raises(ConfigError, match="data.prefetch"):
        cfg.validate(1)
