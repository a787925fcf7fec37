"""The embedded default corpus builds from the local stdlib with no download, is cached, and
leaves nothing partial behind."""

from __future__ import annotations

import os
import time

from zerotron.data import GPTDataset, IndexedTokenDataset, Tokenizer, build_default_corpus


def test_default_corpus(tmp_path):
    cache = str(tmp_path / "cache")
    train, model, evals = build_default_corpus(cache, vocab_size=1024, seed=7)
    t = time.perf_counter()
    assert build_default_corpus(cache, vocab_size=1024, seed=7) == (train, model, evals)
    assert time.perf_counter() - t < 0.1  # cached: no harvesting, no training
    (entry,) = os.listdir(cache)  # one finished directory, no temporary debris
    assert sorted(os.listdir(os.path.join(cache, entry))) == [
        "eval.bin", "eval.idx", "tokenizer.model", "tokenizer.vocab", "train.bin", "train.idx"]
    tok = Tokenizer.load(model)
    tr, ev = IndexedTokenDataset(train), IndexedTokenDataset(evals)
    assert tok.vocab_size == 1024 and tr.dtype.itemsize == 2
    tr.validate_vocab(tok.vocab_size, full_scan=True)
    assert tr.num_tokens > 500_000 and 0 < ev.num_tokens < tr.num_tokens / 10
    doc = tr.get(0)
    assert doc[-1] == tok.eod_id and len(tok.decode(doc[:-1])) >= 40
    ds = GPTDataset(train, None, 128, 64, seed=1, cache_dir=str(tmp_path))
    assert ds[63].shape == (129,) and ds[63].max() < 1024
