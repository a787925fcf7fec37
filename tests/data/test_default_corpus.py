"""The embedded default corpus builds from the local stdlib with no download, is cached, and
leaves nothing partial behind."""

from __future__ import annotations

import os

import zerotron.data.default_corpus as default_corpus
from zerotron.data import GPTDataset, IndexedTokenDataset, Tokenizer, build_default_corpus


def test_default_corpus(tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    train, model, evals = build_default_corpus(cache, vocab_size=1024, seed=7)

    def rebuilt(*args, **kwargs):
        raise AssertionError("the cached corpus was harvested or its tokenizer trained again")

    # cached: no harvesting, no training -- held by the build's own steps, not by a wall clock
    # (0.1 s, which a descheduled process on a loaded machine can exceed without doing either)
    monkeypatch.setattr(default_corpus, "harvest_stdlib_texts", rebuilt)
    monkeypatch.setattr(default_corpus, "train_tokenizer", rebuilt)
    assert build_default_corpus(cache, vocab_size=1024, seed=7) == (train, model, evals)
    monkeypatch.undo()
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
