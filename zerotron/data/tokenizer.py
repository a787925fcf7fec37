"""SentencePiece tokenizer: train one, load one, encode in batches.

Why these training options: a pretraining tokenizer must round-trip text *exactly* (the
acceptance test is text -> ids -> token file -> text), so normalization is ``identity`` (the
default NFKC would rewrite unicode), extra whitespace is kept (code and docstrings live on
indentation), no dummy prefix is added, and ``byte_fallback`` turns any character unseen in
training into UTF-8 byte pieces instead of ``<unk>``. The end-of-document id is SentencePiece's
``</s>``: the data pipeline appends it after every document so packed samples show the model
where one document stops and the next begins.
"""

from __future__ import annotations

import os
from typing import Iterable, Iterator

import sentencepiece as spm

UNK_ID, BOS_ID, EOD_ID = 0, 1, 2
_META = "\u2581"  # SentencePiece's whitespace marker
# SentencePiece skips sentences longer than this; we split documents into lines for training.
_MAX_SENTENCE_BYTES = 1 << 14


class Tokenizer:
    """A loaded SentencePiece model with the four things training needs."""

    bos_id = None  # documents end with eod only: the token files this pipeline always wrote

    def __init__(self, processor: spm.SentencePieceProcessor, model_path: str | None = None):
        self.sp = processor
        self.model_path = model_path

    @classmethod
    def load(cls, model_path: str):
        """A SentencePiece ``.model``, or a Hugging Face tokenizer directory (``HFTokenizer``)."""
        from zerotron.data import hf_tokenizer

        if hf_tokenizer.is_hf_dir(model_path):
            return hf_tokenizer.HFTokenizer.load(model_path)
        if os.path.isdir(model_path):
            raise FileNotFoundError(f"tokenizer {model_path} is a directory without "
                                    f"tokenizer.json; name a SentencePiece .model file "
                                    f"(scripts/train_tokenizer.py writes <prefix>.model) or a "
                                    f"directory transformers' save_pretrained wrote")
        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"tokenizer model {model_path} does not exist; train one with "
                                    f"scripts/train_tokenizer.py")
        sibling = model_path[: -len(".vocab")] + ".model" if model_path.endswith(".vocab") else None
        if sibling and os.path.isfile(sibling):  # train_tokenizer.py writes the pair; the .vocab is text
            raise ValueError(f"{model_path} is the vocabulary listing written beside the tokenizer, not the "
                             f"model; pass {sibling}")
        sp = spm.SentencePieceProcessor()
        try:
            sp.Load(model_path)
        except Exception as exc:
            raise ValueError(f"{model_path} is not a SentencePiece model ({exc}); retrain it with "
                             f"scripts/train_tokenizer.py") from exc
        return cls(sp, model_path)

    @property
    def vocab_size(self) -> int:
        return self.sp.GetPieceSize()

    @property
    def eod_id(self) -> int:
        eod = self.sp.eos_id()
        if eod < 0:
            raise ValueError(f"tokenizer {self.model_path} has no end-of-document (eos) piece; "
                             f"retrain it with scripts/train_tokenizer.py")
        return eod

    def encode(self, text: str) -> list[int]:
        if _META in text:
            return self._encode_with_meta(text)
        return self.sp.EncodeAsIds(text)

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """Encode many texts in one C++ call (``num_threads`` > 1 uses SentencePiece's threads)."""
        out = self.sp.Encode(list(texts), out_type=int, num_threads=num_threads)
        for i, text in enumerate(texts):
            if _META in text:
                out[i] = self._encode_with_meta(text)
        return out

    def _encode_with_meta(self, text: str) -> list[int]:
        """SentencePiece uses U+2581 as its space marker, so a literal one would decode as a
        space. Emit it as its three UTF-8 byte pieces instead, which decode back verbatim."""
        meta = [self.sp.PieceToId(f"<0x{b:02X}>") for b in _META.encode()]
        if self.sp.unk_id() in meta:  # no byte pieces (byte_fallback=False): nothing better
            return self.sp.EncodeAsIds(text)
        ids: list[int] = []
        for i, part in enumerate(text.split(_META)):
            if i:
                ids += meta
            ids += self.sp.EncodeAsIds(part)
        return ids

    def decode(self, ids) -> str:
        return self.sp.DecodeIds([int(i) for i in ids])

    def __getstate__(self):  # picklable for worker processes: ship the serialized model
        return {"proto": self.sp.serialized_model_proto(), "model_path": self.model_path}

    def __setstate__(self, state):
        self.sp = spm.SentencePieceProcessor()
        self.sp.LoadFromSerializedProto(state["proto"])
        self.model_path = state["model_path"]


def _lines(texts_or_files) -> Iterator[str]:
    """Training sentences: the lines of every text (or text file), long lines cut. Within an
    iterable only ``os.PathLike`` items are files: a document whose text happens to name an
    existing file (``notes``, ``/etc/hosts``) must train as that text, not as the file."""
    if isinstance(texts_or_files, (str, os.PathLike)):
        texts_or_files = [os.fspath(texts_or_files)]
        paths = True
    else:
        paths = False
    for item in texts_or_files:
        if isinstance(item, os.PathLike) or (paths and isinstance(item, str)):
            with open(item, encoding="utf-8") as f:
                text = f.read()
        elif isinstance(item, str):
            text = item
        else:
            raise TypeError(f"train_tokenizer takes texts or text-file paths, got {type(item).__name__}")
        for line in text.splitlines():
            while line:
                yield line[:_MAX_SENTENCE_BYTES // 4]
                line = line[_MAX_SENTENCE_BYTES // 4:]


_CHARACTER_COVERAGE = 0.9995  # the rarest 0.05 % of characters become bytes (byte fallback) or <unk>


def train_tokenizer(texts_or_files: Iterable[str] | str, model_prefix: str, vocab_size: int,
                    model_type: str = "bpe", byte_fallback: bool = True, num_threads: int = 2,
                    text_field: str = "text") -> Tokenizer:
    """Train a SentencePiece model; writes ``<model_prefix>.model`` / ``.vocab`` and loads it.

    ``texts_or_files``: the path of one UTF-8 text file; or an iterable of texts (``str``) and
    file paths (``os.PathLike``, e.g. ``pathlib.Path``); or a ``datasets`` Dataset (its
    ``text_field`` column is used).
    """
    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"model_type must be 'bpe' or 'unigram', got {model_type!r}")
    if vocab_size < 1 or num_threads < 1:
        raise ValueError(f"vocab_size={vocab_size} and num_threads={num_threads} must both be >= 1")
    if hasattr(texts_or_files, "column_names") and hasattr(texts_or_files, "map"):
        from zerotron.data.sources import iter_texts
        texts_or_files = iter_texts(texts_or_files, text_field)
    if isinstance(texts_or_files, (str, os.PathLike)) and not os.path.isfile(texts_or_files):
        raise FileNotFoundError(f"tokenizer training file {texts_or_files} does not exist")
    if not isinstance(texts_or_files, (str, os.PathLike)):
        texts_or_files = list(texts_or_files)
        missing = [t for t in texts_or_files if isinstance(t, os.PathLike) and not os.path.isfile(t)]
        if missing:
            raise FileNotFoundError(f"tokenizer training file {missing[0]} does not exist")
    counted = {"n": 0}

    def sentences():
        for line in _lines(texts_or_files):
            counted["n"] += 1
            yield line

    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    try:
        spm.SentencePieceTrainer.Train(
            sentence_iterator=sentences(), model_prefix=model_prefix, vocab_size=vocab_size,
            model_type=model_type, byte_fallback=byte_fallback, character_coverage=_CHARACTER_COVERAGE,
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            add_dummy_prefix=False, allow_whitespace_only_pieces=True, split_digits=True,
            max_sentence_length=_MAX_SENTENCE_BYTES, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOD_ID,
            pad_id=-1, num_threads=num_threads, minloglevel=2, hard_vocab_limit=True)
    except RuntimeError as exc:
        if counted["n"] == 0:
            raise ValueError("empty corpus: no text to train the tokenizer on; check the input "
                             "files and the text field") from exc
        raise ValueError(f"SentencePiece training failed ({exc}); change the vocabulary size (--vocab-size) as it "
                         f"says: its other options (character_coverage {_CHARACTER_COVERAGE}) are fixed here") from exc
    return Tokenizer.load(model_prefix + ".model")


# trainer fields about where and how training ran, not about how text encodes
_TRAINING_IO = ("input", "input_format", "model_prefix", "num_threads")


def document_ids(tok, ids: list[int]) -> list[int]:
    """A document as the token files hold it: its ids between the tokenizer's bos (an HF
    tokenizer's, where it has one) and its end-of-document id."""
    return ([tok.bos_id] if tok.bos_id is not None else []) + ids + [tok.eod_id]


def tokenizer_sha256(path) -> str:
    """SHA-256 of a tokenizer's bytes: the ``.model`` file's, or an HF directory's kept files."""
    import hashlib

    from zerotron.data import hf_tokenizer

    if os.path.isdir(path):
        return hf_tokenizer.files_sha256(path)
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def encoding_digest(model_path: str) -> str:
    """SHA-256 of what decides how a tokenizer encodes (an HF directory's:
    ``hf_tokenizer.encoding_digest``); a SentencePiece model's is the model with the trainer's
    input, output path and thread count cleared. Two builds of one tokenizer differ in their bytes
    (the ``.model`` records the temporary directory it was trained in) but not in this digest;
    any change of a piece, score, id or normalization rule changes it. A file that does not parse
    as a model is hashed as it is."""
    import hashlib

    from sentencepiece import sentencepiece_model_pb2

    from zerotron.data import hf_tokenizer

    if os.path.isdir(model_path):
        return hf_tokenizer.encoding_digest(model_path)
    data = open(model_path, "rb").read()
    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(data)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError; not a model, so its bytes are its identity
        return hashlib.sha256(data).hexdigest()
    for name in _TRAINING_IO:
        proto.trainer_spec.ClearField(name)
    return hashlib.sha256(proto.SerializeToString(deterministic=True)).hexdigest()
