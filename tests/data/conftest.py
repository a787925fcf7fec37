"""Shared fixtures for the data tests: a small corpus with unicode, whitespace and empty
documents, and a tokenizer trained on it (a fraction of a second)."""

from __future__ import annotations

import pytest

from zerotron.data import train_tokenizer

CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "",
    "Unicode: héllo wörld — naïve café, 日本語のテキスト, Ελληνικά, emoji 🎉🚀 and a ▁ marker.",
    "    def indented(code):\n        return code  # keep whitespace\n\n\ttabs\ttoo\r\n",
    "",
    " leading space, trailing space ",
    "Numbers 1234567890 and symbols ~!@#$%^&*()_+{}|:\"<>?",
] + [f"Document {i}: " + "the data pipeline packs documents across boundaries. " * (i % 5) for i in range(60)]


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path_factory, monkeypatch) -> str:
    """Every data test's ``datasets`` cache in pytest's temp directory, not the checkout's ``.cache``
    (where ``load_source`` puts it by default)."""
    path = str(tmp_path_factory.getbasetemp() / "hf-datasets")
    monkeypatch.setenv("HF_DATASETS_CACHE", path)
    return path


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    return list(CORPUS)


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("tok") / "tok"
    return train_tokenizer(CORPUS, str(prefix), vocab_size=400)
