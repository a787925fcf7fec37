"""The trainer and reliability tests' data cache: the built-in corpus and its sample indices,
outside the checkout; and ``overlap`` (``tests.harness.Overlap``) for fault drills that overlap
their idle waits.

Built once per session (about 5 s) under pytest's base temp directory; built in a forked process,
because the pytest process must not start threads before the tests fork their ranks. Each test
still gets its own run and checkpoint directories (``tmp_path``).
"""

from __future__ import annotations

import pytest

from tests.harness import Overlap, spawn


def _build(cache: str) -> None:
    from zerotron.data import build_default_corpus
    from zerotron.training.config import DataSection

    build_default_corpus(cache, vocab_size=DataSection.default_corpus_vocab)


@pytest.fixture(scope="session")
def zerotron_cache(tmp_path_factory) -> str:
    path = tmp_path_factory.getbasetemp() / "zerotron-cache"
    path.mkdir(exist_ok=True)
    spawn(_build, 1, str(path), timeout=300)  # returns at once when the corpus is already there
    return str(path)


@pytest.fixture(scope="module")
def overlap():
    o = Overlap()
    try:
        yield o
    finally:
        o.close()
