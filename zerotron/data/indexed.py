"""Pre-tokenized, memory-mapped token files: ``<prefix>.bin`` + ``<prefix>.idx``.

Why this format: training must start in seconds on a corpus of hundreds of GB, and every DP rank
reads it at once. So tokens are stored flat, one document after another, in the smallest dtype
the vocabulary allows (uint8 / uint16 / uint32: half the disk and page cache of int32 for a 50k
vocabulary) and opened with ``np.memmap`` -- opening reads only the 48-byte header, never the
tokens. The ``.idx`` holds what is needed to find documents without scanning:

    magic  b"ZTRNIDX\\0"       8 bytes
    version                    <u4     (FORMAT_VERSION; a reader refuses any other)
    dtype itemsize             <u1     (1, 2 or 4: unsigned ids in the .bin) + 3 pad bytes
    vocab_size                 <u8     (the vocabulary the writer was given)
    max_token_id               <i8     (largest id written, so vocab checks are O(1))
    num_docs, num_tokens       <u8 <u8
    offsets                    <i8 x (num_docs + 1)   token offset of each document
    sizes                      <i4 x num_docs         tokens per document (empty documents: 0)

The writer publishes both files atomically (tmp + fsync + rename, ``.idx`` last as the commit
marker), so an interrupted or failed run leaves no file that a reader could take for a corpus.
"""

from __future__ import annotations

import contextlib
import os
import struct
from array import array
from typing import Sequence

import numpy as np

from zerotron.data.atomic import publish, tmp_name

MAGIC = b"ZTRNIDX\x00"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIB3xQqQQ")  # 48 bytes
_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32}
_FIX = "re-create it with scripts/preprocess_data.py"


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id in ``[0, vocab_size)``."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    for itemsize, dt in _DTYPES.items():
        if vocab_size <= np.iinfo(dt).max + 1:
            return np.dtype(dt)
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32")


class IndexedTokenWriter:
    """Stream documents into ``<prefix>.bin/.idx``; nothing is visible until a clean close.

    Use as a context manager. Ids are checked against ``vocab_size`` as they arrive (a bad id
    is reported with its document number, not discovered at step 10,000 of training). A corpus
    without a single token is an error: an empty file would only fail later, far from the cause.
    """

    def __init__(self, prefix: str, vocab_size: int):
        self.prefix = str(prefix)
        self.vocab_size = int(vocab_size)
        self.dtype = token_dtype(self.vocab_size)
        os.makedirs(os.path.dirname(os.path.abspath(self.prefix)), exist_ok=True)
        self._bin_tmp = tmp_name(self.prefix + ".bin")
        self._bin = open(self._bin_tmp, "wb", buffering=1 << 22)
        self._sizes = array("q")
        self._max_id = -1
        self._closed = False

    @property
    def num_docs(self) -> int:
        return len(self._sizes)

    @property
    def num_tokens(self) -> int:
        return int(sum(self._sizes)) if self._sizes else 0

    def add_document(self, ids: Sequence[int] | np.ndarray) -> None:
        arr = np.asarray(ids)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise TypeError(f"document {self.num_docs}: expected a 1-D sequence of integer ids, "
                            f"got shape {arr.shape} dtype {arr.dtype}")
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= self.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"document {self.num_docs} of {self.prefix}: token id {bad} is "
                                 f"outside the vocabulary [0, {self.vocab_size}); use the tokenizer "
                                 f"the ids came from, or raise vocab_size")
            self._max_id = max(self._max_id, hi)
            self._bin.write(arr.astype(self.dtype, copy=False).tobytes())
        self._sizes.append(arr.size)

    def add_documents(self, tokens: np.ndarray, sizes: Sequence[int] | np.ndarray) -> None:
        """Add many documents at once: ``tokens`` concatenated, ``sizes`` tokens per document.
        One range check and one write per call -- the fast path of scripts/preprocess_data.py."""
        tokens, sizes = np.asarray(tokens), np.asarray(sizes, dtype=np.int64)
        if tokens.ndim != 1 or sizes.ndim != 1 or int(sizes.sum()) != len(tokens) or (sizes < 0).any():
            raise ValueError(f"add_documents: sizes (sum {int(sizes.sum())}) must describe the "
                             f"{len(tokens)} concatenated tokens")
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            for i, doc in enumerate(np.split(tokens, np.cumsum(sizes)[:-1])):
                self.add_document(doc)  # slow path: reports the offending document
            return
        if tokens.size:
            self._max_id = max(self._max_id, int(tokens.max()))
            self._bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        self._sizes.extend(sizes.tolist())

    def close(self) -> None:
        """Publish both files (``.idx`` last). Raises, and publishes nothing, if no tokens."""
        if self._closed:
            return
        self._closed = True
        try:
            self._bin.close()
            sizes = np.frombuffer(self._sizes, dtype=np.int64) if self._sizes else np.zeros(0, np.int64)
            if sizes.sum() == 0:
                raise ValueError(f"empty corpus: no tokens were written to {self.prefix}.bin "
                                 f"({len(sizes)} documents, all empty); check the input files and "
                                 f"the text field")
            offsets = np.zeros(len(sizes) + 1, np.int64)
            np.cumsum(sizes, out=offsets[1:])
            idx_path = self.prefix + ".idx"
            idx_tmp = tmp_name(idx_path)
            try:
                with open(idx_tmp, "wb") as f:  # written in full first: a full disk leaves the old pair
                    f.write(_HEADER.pack(MAGIC, FORMAT_VERSION, self.dtype.itemsize, self.vocab_size,
                                         self._max_id, len(sizes), int(offsets[-1])))
                    f.write(offsets.tobytes())
                    f.write(sizes.astype(np.int32).tobytes())
                with contextlib.suppress(FileNotFoundError):
                    os.remove(idx_path)  # no moment where an old .idx describes the new .bin
                publish(self._bin_tmp, self.prefix + ".bin")
                publish(idx_tmp, idx_path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(idx_tmp)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._bin_tmp)

    def abort(self) -> None:
        """Drop everything written so far; no output file is touched."""
        if not self._closed:
            self._closed = True
            self._bin.close()
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._bin_tmp)

    def __enter__(self) -> "IndexedTokenWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __del__(self):  # an unclosed writer must not leave a tmp file behind
        with contextlib.suppress(Exception):
            self.abort()


def _identity(path: str) -> tuple:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


class IndexedTokenDataset:
    """Read-only, memory-mapped view of ``<prefix>.bin/.idx``; opening costs O(1) I/O."""

    def __init__(self, prefix: str):
        self.prefix = str(prefix)
        bin_path, idx_path = self.prefix + ".bin", self.prefix + ".idx"
        for p in (idx_path, bin_path):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"token file {p} does not exist; pass the prefix without "
                                        f".bin/.idx, or create it with scripts/preprocess_data.py")
        with open(idx_path, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size or head[:8] != MAGIC:
            raise ValueError(f"{idx_path} is not a zerotron token index (bad magic); {_FIX}")
        (_, version, itemsize, self.vocab_size, self.max_token_id,
         num_docs, self.num_tokens) = _HEADER.unpack(head)
        if version != FORMAT_VERSION:
            raise ValueError(f"{idx_path} has format version {version}, this zerotron reads version "
                             f"{FORMAT_VERSION}; {_FIX}")
        if itemsize not in _DTYPES:
            raise ValueError(f"{idx_path}: unknown token itemsize {itemsize}; {_FIX}")
        self.dtype = np.dtype(_DTYPES[itemsize])
        want_idx = _HEADER.size + 8 * (num_docs + 1) + 4 * num_docs
        if os.path.getsize(idx_path) != want_idx:
            raise ValueError(f"{idx_path} is truncated or corrupt ({os.path.getsize(idx_path)} bytes, "
                             f"expected {want_idx}); {_FIX}")
        want_bin = self.num_tokens * itemsize
        if os.path.getsize(bin_path) != want_bin:
            raise ValueError(f"{bin_path} is truncated or corrupt ({os.path.getsize(bin_path)} bytes, "
                             f"the index says {want_bin}); {_FIX}")
        self.offsets = np.memmap(idx_path, np.int64, "r", offset=_HEADER.size, shape=(num_docs + 1,))
        self.sizes = np.memmap(idx_path, np.int32, "r", offset=_HEADER.size + 8 * (num_docs + 1),
                               shape=(num_docs,))
        if int(self.offsets[-1]) != self.num_tokens:
            raise ValueError(f"{idx_path}: last offset {int(self.offsets[-1])} != num_tokens "
                             f"{self.num_tokens}; {_FIX}")
        self.tokens = np.memmap(bin_path, self.dtype, "r", shape=(self.num_tokens,))
        self._identity = {p: _identity(p) for p in (bin_path, idx_path)}

    def check_unchanged(self) -> None:
        """Raise ``ValueError`` naming the file if ``.bin`` or ``.idx`` was replaced, truncated or
        rewritten since it was opened: reading a memory-mapped file cut short under a running job
        is a SIGBUS that names nothing; a ``stat`` before each read names the file instead."""
        for path, seen in self._identity.items():
            try:
                now = _identity(path)
            except OSError as e:
                now = (None, str(e))
            if now != seen:
                raise ValueError(f"token file {path} changed while the run reads it (replaced, "
                                 f"truncated or rewritten since start-up); restore it, or restart "
                                 f"the run on the new file")

    def __len__(self) -> int:
        return len(self.sizes)

    def get(self, doc_index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of one document (a read-only memmap slice in the stored dtype)."""
        n = len(self)
        if not -n <= doc_index < n:
            raise IndexError(f"document {doc_index} out of range for {self.prefix} ({n} documents)")
        doc_index %= n
        start = int(self.offsets[doc_index]) + offset
        end = int(self.offsets[doc_index + 1]) if length is None else start + length
        return self.tokens[start:end]

    def validate_vocab(self, vocab_size: int, full_scan: bool = False) -> None:
        """Raise ValueError if an id is ``>= vocab_size`` (the model's embedding would be indexed
        out of range, a CUDA assert far from the cause). Uses the header's max id; ``full_scan``
        re-reads every token, in chunks, to also catch a file corrupted after writing."""
        max_id = self.max_token_id
        if full_scan:
            chunk = 1 << 26
            max_id = max(int(self.tokens[i:i + chunk].max()) for i in range(0, self.num_tokens, chunk))
        if max_id >= vocab_size:
            raise ValueError(f"{self.prefix}: token id {max_id} is beyond the model's vocabulary of "
                             f"{vocab_size}; set model vocab_size >= {max_id + 1} or re-tokenize with "
                             f"the model's tokenizer")
