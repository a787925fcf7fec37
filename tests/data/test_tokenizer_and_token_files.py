"""Text -> ids -> token files -> text round-trips exactly; the reader memory-maps; bad token files
fail loudly and no partial output is ever left behind."""

from __future__ import annotations

import os
import struct
import time

import numpy as np
import pytest

from zerotron.data import IndexedTokenDataset, IndexedTokenWriter, Tokenizer, train_tokenizer
from zerotron.data import indexed
from zerotron.data.preprocess import tokenize_to_file


def _outputs(d):
    return sorted(os.listdir(d))


def test_tokenizer_round_trip_and_batch(tokenizer, corpus):
    assert tokenizer.eod_id == 2 and tokenizer.vocab_size == 400
    for text in corpus:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode_batch(corpus, num_threads=2) == [tokenizer.encode(t) for t in corpus]
    again = Tokenizer.load(tokenizer.model_path)
    assert again.encode(corpus[2]) == tokenizer.encode(corpus[2])


@pytest.mark.parametrize("workers", [1, 2])
def test_text_to_token_file_round_trip(tmp_path, tokenizer, corpus, workers):
    prefix = str(tmp_path / "c")
    stats = tokenize_to_file(corpus, tokenizer, prefix, workers=workers, batch_size=4, progress=False)
    ds = IndexedTokenDataset(prefix)
    assert len(ds) == len(corpus) == stats["documents"] and ds.num_tokens == stats["tokens"]
    assert ds.dtype == np.uint16
    for i, text in enumerate(corpus):
        ids = ds.get(i)
        assert ids[-1] == tokenizer.eod_id
        assert tokenizer.decode(ids[:-1]) == text
    assert np.array_equal(np.diff(ds.offsets), ds.sizes)
    assert _outputs(tmp_path) == ["c.bin", "c.idx", "c.tokenizer.json"]  # its tokenizer, recorded


@pytest.mark.parametrize("vocab,dtype", [(256, np.uint8), (300, np.uint16), (65536, np.uint16),
                                         (70000, np.uint32)])
def test_smallest_dtype(tmp_path, vocab, dtype):
    with IndexedTokenWriter(str(tmp_path / "t"), vocab) as w:
        w.add_document([0, vocab - 1])
        w.add_document([])
    ds = IndexedTokenDataset(str(tmp_path / "t"))
    assert ds.dtype == dtype and ds.get(0).tolist() == [0, vocab - 1] and len(ds.get(1)) == 0


def _bytes_read() -> int:
    """Bytes this process has read through read(2) and friends (not through a memory map)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="reads counted by Linux's /proc")
def test_one_gigabyte_file_opens_instantly(tmp_path):
    """A sparse 1 GB .bin with a valid .idx: opening must not read the tokens."""
    prefix = str(tmp_path / "big")
    n = 1 << 29  # uint16 tokens -> 1 GiB
    with open(prefix + ".bin", "wb") as f:
        f.truncate(2 * n)
    with open(prefix + ".idx", "wb") as f:
        f.write(indexed._HEADER.pack(indexed.MAGIC, indexed.FORMAT_VERSION, 2, 1000, 999, 1, n))
        f.write(np.asarray([0, n], np.int64).tobytes() + np.asarray([n], np.int32).tobytes())
    # "Instantly" held by what the open costs this process, not by a wall clock that a loaded
    # machine can stall past: it reads (read(2): rchar) none of the 1 GiB, and spends under 0.5 s
    # of CPU time, which touching its pages through the map (seconds of CPU) would exceed.
    read_before, cpu_before = _bytes_read(), time.process_time()
    ds = IndexedTokenDataset(prefix)
    read, cpu_s = _bytes_read() - read_before, time.process_time() - cpu_before
    assert read < 1 << 20 and cpu_s < 0.5, (read, cpu_s)
    assert isinstance(ds.tokens, np.memmap) and ds.num_tokens == n and ds.get(0, n - 3).tolist() == [0, 0, 0]


def test_vocab_check(tmp_path):
    prefix = str(tmp_path / "v")
    with IndexedTokenWriter(prefix, 1000) as w:
        w.add_document([1, 2, 700])
    ds = IndexedTokenDataset(prefix)
    ds.validate_vocab(701)
    ds.validate_vocab(701, full_scan=True)
    with pytest.raises(ValueError, match="token id 700 is beyond the model's vocabulary of 512"):
        ds.validate_vocab(512)


def test_id_beyond_vocab_writes_nothing(tmp_path):
    with pytest.raises(ValueError, match="document 1 .*token id 300 is outside the vocabulary"):
        with IndexedTokenWriter(str(tmp_path / "x"), 300) as w:
            w.add_document([1, 2])
            w.add_document([5, 300])
    with pytest.raises(ValueError, match="document 2 .*token id 300 is outside"):
        with IndexedTokenWriter(str(tmp_path / "y"), 300) as w:
            w.add_documents(np.asarray([1, 2, 3, 4, 300]), [2, 2, 1])
    assert _outputs(tmp_path) == []


def test_empty_corpus_writes_nothing(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="empty corpus"):
        with IndexedTokenWriter(str(tmp_path / "e"), 300) as w:
            w.add_document([])
    with pytest.raises(ValueError, match="empty corpus"):
        tokenize_to_file([], tokenizer, str(tmp_path / "e2"), progress=False)
    with pytest.raises(ValueError, match="empty corpus"):
        train_tokenizer([], str(tmp_path / "tk"), vocab_size=400)
    assert [f for f in _outputs(tmp_path) if not f.startswith("tk")] == []


def _good(tmp_path) -> str:
    prefix = str(tmp_path / "g")
    with IndexedTokenWriter(prefix, 300) as w:
        w.add_document(list(range(50)))
        w.add_document([7, 8])
    return prefix


def test_a_rewrite_that_fails_leaves_the_old_token_files(tmp_path, monkeypatch):
    """A full disk while the new ``.idx`` is written: the corpus already there still opens, whole."""
    prefix = _good(tmp_path)

    class FullDisk:
        def pack(self, *a):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(indexed, "_HEADER", FullDisk())
    with pytest.raises(OSError, match="No space"):
        with IndexedTokenWriter(prefix, 300) as w:
            w.add_document([1, 2, 3])
    monkeypatch.undo()
    ds = IndexedTokenDataset(prefix)
    assert len(ds) == 2 and ds.get(0).tolist() == list(range(50)) and ds.get(1).tolist() == [7, 8]
    assert _outputs(tmp_path) == ["g.bin", "g.idx"]


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.idx does not exist.*preprocess_data"):
        IndexedTokenDataset(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="tokenizer model .* does not exist"):
        Tokenizer.load(str(tmp_path / "nope.model"))


def test_the_vocab_listing_beside_a_model_is_named_for_what_it_is(tokenizer):
    """train_tokenizer.py writes PREFIX.model and PREFIX.vocab; passing the .vocab is a slip of the
    suffix, so the fix is the .model beside it, not a retrained tokenizer."""
    listing = tokenizer.model_path[: -len(".model")] + ".vocab"
    with pytest.raises(ValueError, match=r"\.vocab is the vocabulary listing .*; pass .*tok\.model"):
        Tokenizer.load(listing)


def test_other_format_version(tmp_path):
    prefix = _good(tmp_path)
    with open(prefix + ".idx", "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", 99))
    with pytest.raises(ValueError, match=r"g\.idx has format version 99, this zerotron reads version 1"):
        IndexedTokenDataset(prefix)


def test_truncated_bin_and_idx(tmp_path):
    prefix = _good(tmp_path)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(prefix + ".bin") - 2)
    with pytest.raises(ValueError, match=r"g\.bin is truncated"):
        IndexedTokenDataset(prefix)
    prefix = _good(tmp_path)
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(60)
    with pytest.raises(ValueError, match=r"g\.idx is truncated"):
        IndexedTokenDataset(prefix)
    with open(prefix + ".idx", "wb") as f:
        f.write(b"garbage")
    with pytest.raises(ValueError, match="bad magic"):
        IndexedTokenDataset(prefix)


def test_a_text_that_names_a_file_trains_as_text(tmp_path, monkeypatch):
    from pathlib import Path

    from zerotron.data.tokenizer import _lines
    (tmp_path / "notes").write_text("contents of an unrelated file\n")
    monkeypatch.chdir(tmp_path)
    assert list(_lines(["hello", "notes"])) == ["hello", "notes"]  # documents, e.g. from a .jsonl
    assert list(_lines([Path("notes")])) == ["contents of an unrelated file"]
    assert list(_lines("notes")) == ["contents of an unrelated file"]  # the one-path form
