"""Data faults are start-up errors on every rank (exit 2, naming the field, the file and the fix),
never a crash mid-run: a truncated .bin, an .idx whose sizes disagree with its offsets, a
tokenizer whose vocabulary exceeds model.vocab_size."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from tests.reliability.common import run, tiny
from zerotron.data import IndexedTokenWriter, train_tokenizer
from zerotron.config.cli import last_wins, parse_config
from zerotron.training.setup_run import preflight

TEXTS = [f"Document {i}: the data pipeline packs documents across boundaries. " * (1 + i % 4) for i in range(200)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    tok = train_tokenizer(TEXTS, str(root / "tok"), vocab_size=300)
    with IndexedTokenWriter(str(root / "train"), tok.vocab_size) as w:
        for text in TEXTS:
            w.add_document(tok.encode(text) + [tok.eod_id])
    return root


def _argv(root, prefix="train", extra=()):
    return tiny(str(root / "cache")) + ["--train-steps", "2", "--run-dir", str(root / "run"),
                                        "--data.data_path", str(root / prefix),
                   "--data.tokenizer", str(root / "tok.model"), *extra]


def test_the_uncorrupted_corpus_passes_preflight_and_trains(corpus):
    cfg = parse_config(last_wins(_argv(corpus)))
    preflight(cfg.validate(2))
    res = run(_argv(corpus), world=2)
    assert [r[0] for r in res] == [0, 0], res[0][2]


def _corrupt(root, kind: str) -> str:
    name = f"bad_{kind}"
    for ext in (".bin", ".idx"):
        shutil.copy(root / f"train{ext}", root / f"{name}{ext}")
    if kind == "truncated_bin":
        with open(root / f"{name}.bin", "r+b") as f:
            f.truncate(os.path.getsize(root / f"{name}.bin") - 10)
    elif kind == "idx_sizes":
        idx = np.memmap(root / f"{name}.idx", np.uint8, "r+")
        n_docs = len(TEXTS)
        sizes_at = 48 + 8 * (n_docs + 1)  # header, offsets, then int32 sizes
        sizes = idx[sizes_at:sizes_at + 4 * n_docs].view(np.int32)
        sizes[5] += 7
        idx.flush()
    return name


@pytest.mark.parametrize("kind, field, words", [
    ("truncated_bin", "data.data_path", ["bad_truncated_bin.bin is truncated or corrupt", "preprocess_data.py"]),
    ("idx_sizes", "data.data_path", ["bad_idx_sizes.idx is corrupt: document 5", "preprocess_data.py"]),
    ("vocab", "model.vocab_size", ["data.tokenizer has 300 tokens but model.vocab_size=256", "raise model.vocab_size"]),
])
def test_data_fault_is_a_start_up_error_on_every_rank(corpus, kind, field, words):
    if kind == "vocab":
        argv = _argv(corpus, extra=["--model.vocab_size", "256"])
    else:
        argv = _argv(corpus, prefix=_corrupt(corpus, kind))
    res = run(argv, world=2)
    for rank, (code, _, err, _) in enumerate(res):
        assert code == 2, err
        assert f"[rank {rank}] config error:" in err and field in err, err
        for w in words:
            assert w in err, err
        assert "Traceback" not in err


def test_a_built_in_corpus_that_cannot_be_built_stops_every_rank(tmp_path):
    """Rank 0 builds the built-in corpus after start-up; its failure (here sentencepiece refusing a
    vocabulary smaller than the corpus's alphabet) reaches the rank waiting for it, so both exit 2
    naming the field instead of one traceback and one rank left in a collective."""
    res = run(tiny(str(tmp_path / "cache")) + ["--train-steps", "2", "--run-dir", str(tmp_path / "run"),
                                               "--data.default_corpus_vocab", "5"], world=2,
              collective_timeout=120)  # rank 1 waits while rank 0 gathers the corpus's text
    for code, _, err, _ in res:
        assert code == 2, err
        assert "the built-in corpus could not be built" in err and "data.default_corpus_vocab=5" in err, err
