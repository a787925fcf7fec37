"""Weighted blending of several token files into one sample stream.

Why this construction: Megatron chooses, for each sample, the dataset furthest behind its target
share -- a Python loop over every sample (or a C++ helper). The same property falls out of a
sort: dataset ``d``'s ``k``-th sample is placed at position ``(k + 0.5) / w_d`` on a common axis,
and the merged order of all placements is the blend. Every prefix of the blend is then within one
sample of ``w_d * n`` for every dataset, the result is deterministic (ties broken by dataset
order), and it costs one vectorized ``argsort`` instead of a loop.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def normalize_weights(weights: Sequence[float] | None, num_datasets: int) -> np.ndarray:
    """Weights as float64 summing to one; ``None`` means equal weights. A zero weight is allowed
    (the run config accepts one, to switch a file off without editing the path list) as long as
    one weight is positive."""
    if num_datasets == 0:
        raise ValueError("no token files given; pass at least one data prefix")
    if weights is None:
        return np.full(num_datasets, 1.0 / num_datasets)
    w = np.asarray(list(weights), dtype=np.float64)
    if w.shape != (num_datasets,):
        raise ValueError(f"got {len(w)} blend weights for {num_datasets} data prefixes; give one "
                         f"weight per prefix")
    if not np.all(np.isfinite(w)) or np.any(w < 0) or not w.sum() > 0:
        raise ValueError(f"blend weights must be finite and >= 0 with at least one positive, got {w.tolist()}")
    return w / w.sum()


def blend_index(weights: np.ndarray, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """For each blended sample: which dataset it comes from and that dataset's sample number."""
    ids, ranks, places = [], [], []
    for d, w in enumerate(weights):
        if w == 0:
            continue
        k = np.arange(int(np.ceil(w * num_samples)) + len(weights) + 1, dtype=np.int64)
        ids.append(np.full(len(k), d, dtype=np.int16))
        ranks.append(k)
        places.append((k + 0.5) / w)
    ids_a, ranks_a, places_a = map(np.concatenate, (ids, ranks, places))
    order = np.lexsort((ids_a, places_a))[:num_samples]
    return ids_a[order], ranks_a[order]


def samples_per_dataset(dataset_index: np.ndarray, num_datasets: int) -> list[int]:
    """How many samples each dataset must provide for this blend."""
    return np.bincount(dataset_index, minlength=num_datasets).astype(int).tolist()
