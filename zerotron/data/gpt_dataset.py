"""GPT samples packed across document boundaries, shuffled, with a cached sample index.

Why packing: documents vary from a few tokens to a book; cutting the token stream into fixed
windows wastes no compute on padding. Sample ``i`` of an epoch covers tokens
``[i * seq, i * seq + seq + 1)`` of that epoch's stream (Megatron's convention): inputs are the
first ``seq`` tokens, targets the last ``seq``, so consecutive samples share one token and every
token is an input exactly once per epoch. Each epoch concatenates the documents in a fresh
seeded order; the ``T - n * seq`` tokens (between 1 and ``seq``) after the last full sample of an
epoch are dropped for that epoch (``n = (T - 1) // seq``). Samples are then shuffled within each
epoch, so sample numbers ``[e * n, (e + 1) * n)`` are epoch ``e``.

Why a cache: the index is built with numpy in one pass, but on a large corpus that still takes
seconds per rank and must be bit-identical everywhere. Rank 0 calls ``prepare_dataset_index``
(atomic ``.npy`` files next to the data, ``allow_pickle=False`` on load), the trainer runs a
barrier, and every rank memory-maps the same files.
"""

from __future__ import annotations

import hashlib
import os
from typing import Sequence

import numpy as np

from zerotron.data.atomic import atomic_dir
from zerotron.data.blending import blend_index, normalize_weights, samples_per_dataset
from zerotron.data.indexed import IndexedTokenDataset

INDEX_VERSION = 1
_ARRAYS = ("doc_order", "sample_doc", "sample_offset", "shuffle")


def _cache_path(ds: IndexedTokenDataset, seq_length: int, num_samples: int, seed: int,
                cache_dir: str | None) -> str:
    h = hashlib.sha1()
    h.update(np.asarray([INDEX_VERSION, len(ds), ds.num_tokens, seq_length, num_samples, seed],
                        dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(ds.sizes).tobytes())
    base = os.path.basename(ds.prefix)
    where = cache_dir or os.path.dirname(os.path.abspath(ds.prefix))
    return os.path.join(where, f"{base}.s{seq_length}.n{num_samples}.seed{seed}.{h.hexdigest()[:12]}.gptidx")


def _check(seq_length: int, num_samples: int) -> None:
    if seq_length <= 0:
        raise ValueError(f"seq_length must be positive, got {seq_length}")
    if num_samples <= 0:
        raise ValueError(f"num_samples must be positive, got {num_samples}")


def _build_arrays(ds: IndexedTokenDataset, seq_length: int, num_samples: int, seed: int) -> dict:
    sizes = np.asarray(ds.sizes, dtype=np.int64)
    per_epoch = (ds.num_tokens - 1) // seq_length
    if per_epoch == 0:
        raise ValueError(f"{ds.prefix} holds {ds.num_tokens} tokens, fewer than seq_length + 1 = "
                         f"{seq_length + 1}; use a shorter seq_length or a larger corpus")
    epochs = -(-num_samples // per_epoch)
    rng = np.random.default_rng(seed)
    idx_t = np.int32 if len(sizes) < 2**31 else np.int64
    doc_order = np.empty((epochs, len(sizes)), dtype=idx_t)
    sample_doc = np.empty(epochs * per_epoch, dtype=idx_t)
    sample_offset = np.empty(epochs * per_epoch, dtype=np.int32)
    shuffle = np.empty(epochs * per_epoch, dtype=np.int64)
    starts = np.arange(per_epoch, dtype=np.int64) * seq_length
    for e in range(epochs):
        order = rng.permutation(len(sizes)).astype(idx_t)
        ends = np.cumsum(sizes[order])
        pos = np.searchsorted(ends, starts, side="right")  # skips empty documents
        doc_order[e] = order
        sl = slice(e * per_epoch, (e + 1) * per_epoch)
        sample_doc[sl] = pos
        sample_offset[sl] = starts - (ends[pos] - sizes[order[pos]])
        shuffle[sl] = rng.permutation(per_epoch) + e * per_epoch
    return {"doc_order": doc_order, "sample_doc": sample_doc, "sample_offset": sample_offset,
            "shuffle": shuffle[:num_samples]}


def build_index_cache(prefix: str, seq_length: int, num_samples: int, seed: int,
                      cache_dir: str | None = None) -> str:
    """Build (once) and return the cache directory of one token file's sample index."""
    _check(seq_length, num_samples)
    ds = IndexedTokenDataset(prefix)
    path = _cache_path(ds, seq_length, num_samples, seed, cache_dir)
    if not os.path.isdir(path):
        arrays = _build_arrays(ds, seq_length, num_samples, seed)
        with atomic_dir(path) as tmp:
            for name in _ARRAYS:
                np.save(os.path.join(tmp, name + ".npy"), arrays[name], allow_pickle=False)
    return path


class PackedDataset:
    """One token file seen as ``num_samples`` packed samples of ``seq_length + 1`` tokens."""

    def __init__(self, prefix: str, seq_length: int, num_samples: int, seed: int,
                 cache_dir: str | None = None, build_missing: bool = True):
        _check(seq_length, num_samples)
        self.tokens = IndexedTokenDataset(prefix)
        self.seq_length, self.num_samples = seq_length, num_samples
        path = _cache_path(self.tokens, seq_length, num_samples, seed, cache_dir)
        if not os.path.isdir(path):
            if not build_missing:
                raise FileNotFoundError(f"sample index {path} is missing; call "
                                        f"zerotron.data.prepare_dataset_index on rank 0 first")
            build_index_cache(prefix, seq_length, num_samples, seed, cache_dir)
        a = {n: np.load(os.path.join(path, n + ".npy"), mmap_mode="r", allow_pickle=False)
             for n in _ARRAYS}
        self.doc_order, self.sample_doc = a["doc_order"], a["sample_doc"]
        self.sample_offset, self.shuffle = a["sample_offset"], a["shuffle"]
        self.samples_per_epoch = len(self.sample_doc) // len(self.doc_order)
        self.cache_path = path

    def __len__(self) -> int:
        return self.num_samples

    def locate(self, i: int, position: int) -> int:
        """The document (number in this token file) that token ``position`` of sample ``i`` comes
        from: the walk of ``__getitem__``, so a bad id can be reported where it lies on disk."""
        j = int(self.shuffle[i])
        order = self.doc_order[j // self.samples_per_epoch]
        pos, offset = int(self.sample_doc[j]), int(self.sample_offset[j])
        while True:
            doc = int(order[pos])
            left = int(self.tokens.sizes[doc]) - offset
            if position < left:
                return doc
            position, pos, offset = position - max(left, 0), pos + 1, 0

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        j = int(self.shuffle[i])
        order = self.doc_order[j // self.samples_per_epoch]
        pos, offset = int(self.sample_doc[j]), int(self.sample_offset[j])
        out = np.empty(self.seq_length + 1, dtype=np.int64)
        filled = 0
        while filled < len(out):
            doc = self.tokens.get(int(order[pos]), offset)[: len(out) - filled]
            out[filled:filled + len(doc)] = doc
            filled += len(doc)
            pos, offset = pos + 1, 0
        return out


class GPTDataset:
    """``num_samples`` samples of ``seq_length + 1`` int64 tokens from one or several (blended,
    by ``weights``) token files. ``weights=None`` blends several files by their token counts, as
    Megatron does and ``data.data_weights`` promises ("empty: by size"): equal shares would
    repeat a small file many times over within one pass of a large one."""

    def __init__(self, prefixes: str | Sequence[str], weights: Sequence[float] | None,
                 seq_length: int, num_samples: int, seed: int, cache_dir: str | None = None,
                 build_missing: bool = True):
        _check(seq_length, num_samples)
        self.prefixes = [prefixes] if isinstance(prefixes, (str, os.PathLike)) else list(prefixes)
        if weights is None and len(self.prefixes) > 1:
            weights = [IndexedTokenDataset(str(p)).num_tokens for p in self.prefixes]
        self.weights = normalize_weights(weights, len(self.prefixes))
        self.seq_length, self.num_samples = seq_length, num_samples
        if len(self.prefixes) == 1:
            self.dataset_index = self.dataset_sample_index = None
            counts = [num_samples]
        else:
            self.dataset_index, self.dataset_sample_index = blend_index(self.weights, num_samples)
            counts = samples_per_dataset(self.dataset_index, len(self.prefixes))
        self.datasets = [PackedDataset(str(p), seq_length, max(n, 1), seed, cache_dir, build_missing)
                         for p, n in zip(self.prefixes, counts)]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        if self.dataset_index is None:
            return self.datasets[0][i]
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]

    def check_unchanged(self) -> None:
        """Raise ``ValueError`` naming a token file that changed since it was opened."""
        for d in self.datasets:
            d.tokens.check_unchanged()

    def locate(self, i: int, position: int) -> tuple[str, int]:
        """``(token file prefix, document number)`` of token ``position`` of sample ``i``."""
        d, k = (0, i) if self.dataset_index is None else (int(self.dataset_index[i]),
                                                           int(self.dataset_sample_index[i]))
        return self.prefixes[d], self.datasets[d].locate(k, position)


def prepare_dataset_index(prefixes: str | Sequence[str], weights: Sequence[float] | None,
                          seq_length: int, num_samples: int, seed: int,
                          cache_dir: str | None = None) -> list[str]:
    """Rank 0 calls this before the barrier; then every rank constructs ``GPTDataset`` with the
    same arguments and finds the cache. Returns the cache directories."""
    ds = GPTDataset(prefixes, weights, seq_length, num_samples, seed, cache_dir, build_missing=True)
    return [d.cache_path for d in ds.datasets]
