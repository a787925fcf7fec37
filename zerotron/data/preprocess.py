"""Texts -> token file, on several processes, in bounded memory, with progress (``data/progress.py``).

Why a hand-rolled pool: ``Pool.imap`` drains its input iterator as fast as it can, so on a
streaming corpus larger than memory it buffers the whole corpus. Here at most ``2 * workers``
batches are in flight; the main process writes results in input order (document order in the
token file is the corpus order, so a rerun is byte-identical) while the workers encode.
"""

from __future__ import annotations

import collections
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
import resource
import time
from typing import Iterable, Iterator

import numpy as np

from zerotron.data import fingerprint
from zerotron.data.indexed import IndexedTokenWriter
from zerotron.data.progress import Progress
from zerotron.data.tokenizer import Tokenizer, document_ids

_worker_tok: Tokenizer | None = None


def _init_worker(tokenizer: Tokenizer) -> None:
    global _worker_tok
    _worker_tok = tokenizer


def _encode(texts: list[str], append_eod: bool) -> tuple[np.ndarray, np.ndarray, int]:
    """One batch -> (concatenated ids, ids per document, content tokens without EOD): one array
    crosses the process boundary instead of one per document."""
    dt = np.uint16 if _worker_tok.vocab_size <= 65536 else np.uint32
    encoded = _worker_tok.encode_batch(texts)
    sizes = np.fromiter((len(ids) for ids in encoded), dtype=np.int64, count=len(encoded))
    content = int(sizes.sum())
    if append_eod:  # eod after each document, and an HF tokenizer's bos before it
        encoded = [document_ids(_worker_tok, ids) for ids in encoded]
        sizes += 1 + (_worker_tok.bos_id is not None)
    flat = np.fromiter((i for ids in encoded for i in ids), dtype=dt, count=int(sizes.sum()))
    return flat, sizes, content


def _batches(texts: Iterable[str], batch_size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for t in texts:
        batch.append(t)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def peak_rss_mb() -> tuple[float, float]:
    """(this process, largest finished child) peak resident memory in MB (Linux: ru_maxrss KB)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return own, child


class WorkerDied(RuntimeError):
    """A tokenizer worker process was killed; the pool cannot finish the file."""


def tokenize_to_file(texts: Iterable[str], tokenizer: Tokenizer, output_prefix: str,
                     workers: int = 1, append_eod: bool = True, batch_size: int = 256,
                     progress: bool = True, total_docs: int | None = None) -> dict:
    """Encode ``texts`` into ``<output_prefix>.bin/.idx``; returns throughput statistics.

    ``append_eod`` ends every document with ``tokenizer.eod_id`` (so an empty document still
    marks a boundary) and starts it with an HF tokenizer's bos, where it has one. ``total_docs`` (when known) gives the progress its total and ETA. On any
    error nothing is published.
    """
    bar = Progress(f"tokenizing -> {output_prefix}", total=total_docs, unit="doc", enabled=progress)
    start = time.perf_counter()
    # an executor, not a Pool: a worker that dies (the OOM killer, kill -9) breaks it and every
    # pending result raises, where a Pool would wait forever for the lost task
    pool = (ProcessPoolExecutor(workers, mp.get_context("fork"), _init_worker, (tokenizer,))
            if workers > 1 else None)
    if pool is None:
        _init_worker(tokenizer)
    docs = content = 0
    fingerprint.forget(output_prefix)  # the files are about to change; the record comes after them
    try:
        with IndexedTokenWriter(output_prefix, tokenizer.vocab_size) as writer:
            pending: collections.deque = collections.deque()

            def drain_one() -> None:
                nonlocal docs, content
                result = pending.popleft()
                try:
                    flat, sizes, n_content = result.result() if pool is not None else result
                except BrokenProcessPool:
                    raise WorkerDied(f"a tokenizer worker process died (killed, perhaps by the "
                                     f"OOM killer); nothing was written to {output_prefix}: "
                                     f"rerun with fewer --workers or more memory") from None
                writer.add_documents(flat, sizes)
                content += n_content
                docs += len(sizes)
                bar.update(len(sizes), tokens=len(flat))

            for batch in _batches(texts, batch_size):
                pending.append(pool.submit(_encode, batch, append_eod) if pool
                               else _encode(batch, append_eod))
                while len(pending) > (2 * workers if pool else 0):
                    drain_one()
            while pending:
                drain_one()
            if content == 0:  # only end-of-document markers: nothing to train on
                raise ValueError(f"empty corpus: the {docs} input documents hold no text, nothing "
                                 f"written to {output_prefix}; check the inputs and the text field")
            tokens = writer.num_tokens
        if tokenizer.model_path:
            fingerprint.record(output_prefix, tokenizer.model_path)
    finally:
        bar.close()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    seconds = time.perf_counter() - start
    own, child = peak_rss_mb()
    return {"documents": docs, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / max(seconds, 1e-9), "peak_rss_mb": own,
            "peak_worker_rss_mb": child}
