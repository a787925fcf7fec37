"""Packed GPT samples: every token once per epoch (counted), identical shuffle across runs and
processes, the index built once and cached, and weighted blending."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from zerotron.data import GPTDataset, IndexedTokenWriter, prepare_dataset_index


def _unique_corpus(path, seed=0, docs=40, base=0):
    """Documents of random sizes (some empty) whose tokens are all distinct, so a count of each
    token value is a count of each corpus position."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 30, size=docs)
    sizes[[i for i in (3, 17) if i < docs]] = 0
    prefix = str(path)
    with IndexedTokenWriter(prefix, 100_000) as w:
        start = base
        for s in sizes:
            w.add_document(np.arange(start, start + s))
            start += s
    return prefix, int(sizes.sum())


def test_every_token_once_per_epoch(tmp_path):
    prefix, total = _unique_corpus(tmp_path / "u")
    seq = 7
    per_epoch = (total - 1) // seq
    epochs = 3
    ds = GPTDataset([prefix], None, seq, epochs * per_epoch, seed=5, cache_dir=str(tmp_path))
    packed = ds.datasets[0]
    assert packed.samples_per_epoch == per_epoch
    tokens = packed.tokens
    orders = []
    for e in range(epochs):
        samples = np.stack([ds[i] for i in range(e * per_epoch, (e + 1) * per_epoch)])
        assert samples.shape == (per_epoch, seq + 1) and samples.dtype == np.int64
        stream = np.concatenate([tokens.get(int(d)) for d in packed.doc_order[e]]).astype(np.int64)
        inputs = samples[:, :seq].ravel()
        counts = np.bincount(inputs, minlength=total)
        assert counts.max() == 1  # no token twice
        missing = np.flatnonzero(counts == 0)
        # exactly the documented remainder: the tail after the last full sample, 1..seq tokens
        assert 1 <= len(missing) <= seq and len(missing) == total - per_epoch * seq
        assert sorted(missing.tolist()) == sorted(stream[per_epoch * seq:].tolist())
        for s in samples:  # each sample is a contiguous window of the epoch's stream
            k = int(np.flatnonzero(stream == s[0])[0])
            assert k % seq == 0 and np.array_equal(s, stream[k:k + seq + 1])
        orders.append(tuple(packed.doc_order[e]))
    assert len(set(orders)) == epochs  # a fresh document order each epoch


def _digest(prefix, cache_dir):
    ds = GPTDataset(prefix, None, 5, 120, seed=11, cache_dir=cache_dir)
    return hash(np.stack([ds[i] for i in range(len(ds))]).tobytes())


def test_shuffle_identical_across_runs_and_processes(tmp_path):
    prefix, _ = _unique_corpus(tmp_path / "u")
    a = GPTDataset(prefix, None, 5, 120, seed=11, cache_dir=str(tmp_path / "c1"))
    b = GPTDataset(prefix, None, 5, 120, seed=11, cache_dir=str(tmp_path / "c2"))
    c = GPTDataset(prefix, None, 5, 120, seed=12, cache_dir=str(tmp_path / "c3"))
    sa = np.stack([a[i] for i in range(120)])
    assert np.array_equal(sa, np.stack([b[i] for i in range(120)]))
    assert not np.array_equal(sa, np.stack([c[i] for i in range(120)]))
    code = ("import sys, hashlib, numpy as np; from zerotron.data import GPTDataset;"
            "ds = GPTDataset(sys.argv[1], None, 5, 120, seed=11, cache_dir=sys.argv[2]);"
            "print(hashlib.sha1(np.stack([ds[i] for i in range(120)]).tobytes()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code, prefix, str(tmp_path / "c4")], check=True,
                         capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(
                             os.path.dirname(os.path.abspath(__file__))))).stdout.strip()
    import hashlib
    assert out == hashlib.sha1(sa.tobytes()).hexdigest()


def test_index_cached_once_and_required(tmp_path):
    prefix, total = _unique_corpus(tmp_path / "u")
    cache = str(tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match="prepare_dataset_index on rank 0"):
        GPTDataset(prefix, None, 5, 500, seed=1, cache_dir=cache, build_missing=False)
    (path,) = prepare_dataset_index(prefix, None, 5, 500, seed=1, cache_dir=cache)
    assert sorted(os.listdir(path)) == ["doc_order.npy", "sample_doc.npy", "sample_offset.npy", "shuffle.npy"]
    assert os.listdir(cache) == [os.path.basename(path)]  # no temporary debris
    mtime = os.stat(path).st_mtime_ns
    ds = GPTDataset(prefix, None, 5, 500, seed=1, cache_dir=cache, build_missing=False)
    assert os.stat(path).st_mtime_ns == mtime and len(ds) == 500  # several epochs were needed
    assert len(ds.datasets[0].doc_order) == -(-500 // ((total - 1) // 5))
    default = GPTDataset(prefix, None, 5, 10, seed=1)  # cache next to the data
    assert os.path.dirname(default.datasets[0].cache_path) == str(tmp_path)


def test_bad_arguments(tmp_path):
    prefix, total = _unique_corpus(tmp_path / "u", docs=3)
    with pytest.raises(ValueError, match="fewer than seq_length"):
        GPTDataset(prefix, None, total, 10, seed=0)
    with pytest.raises(ValueError, match="2 blend weights for 1 data prefixes"):
        GPTDataset(prefix, [1, 2], 4, 10, seed=0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        GPTDataset(str(tmp_path / "missing"), None, 4, 10, seed=0)
    with pytest.raises(IndexError):
        GPTDataset(prefix, None, 2, 10, seed=0)[10]


def test_blending_follows_weights(tmp_path):
    pa, ta = _unique_corpus(tmp_path / "a", seed=1, base=0)
    pb, tb = _unique_corpus(tmp_path / "b", seed=2, base=50_000)
    n = 1000
    ds = GPTDataset([pa, pb], [0.3, 0.7], 4, n, seed=3)
    from_b = np.asarray([ds[i][0] >= 50_000 for i in range(n)])
    assert np.array_equal(from_b, ds.dataset_index == 1)
    prefix_counts = np.cumsum(from_b)
    target = 0.7 * np.arange(1, n + 1)
    assert np.abs(prefix_counts - target).max() <= 1.0  # on target at every prefix of the blend
    assert len(ds.datasets[1]) == int(from_b.sum())


def test_blending_without_weights_is_by_size_and_a_zero_weight_is_off(tmp_path):
    pa, ta = _unique_corpus(tmp_path / "a", seed=1, docs=20, base=0)
    pb, tb = _unique_corpus(tmp_path / "b", seed=2, docs=80, base=50_000)
    n = 600
    ds = GPTDataset([pa, pb], None, 4, n, seed=3)  # data.data_weights empty: "by size"
    share_b = float(np.mean(ds.dataset_index == 1))
    assert abs(share_b - tb / (ta + tb)) <= 1 / n
    off = GPTDataset([pa, pb], [1.0, 0.0], 4, n, seed=3)  # accepted by RunConfig.validate
    assert all(off[i][0] < 50_000 for i in range(n))
