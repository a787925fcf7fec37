"""A Hugging Face tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``) as a run's
tokenizer: what Llama-3, Qwen-2.5 and Mistral ship instead of a SentencePiece ``.model``.

Why through ``tokenizers`` and not ``AutoTokenizer``: the fast tokenizer's ``tokenizer.json`` is
the whole encoding (normalizer, pre-tokenizer, model, added tokens), it loads in milliseconds
from local files (nothing is ever downloaded) and pickles to worker processes; transformers'
wrapper adds only the special-token names, read here from ``tokenizer_config.json`` (or
``special_tokens_map.json``). Text is encoded without the post-processor's specials; documents
are delimited by the tokenizer's own ids instead: ``[bos] + ids + [eos]`` (no bos when the
tokenizer has none, as Qwen2's), eos being the end-of-document id the pipeline appends.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

TOKENIZER_JSON = "tokenizer.json"
# what decides the ids: the encoding itself and which tokens are bos/eos
ENCODING_FILES = (TOKENIZER_JSON, "tokenizer_config.json", "special_tokens_map.json")
# the files a checkpoint keeps and an export writes back (the .model serves sentencepiece users)
KEPT_FILES = ENCODING_FILES + ("tokenizer.model",)


def is_hf_dir(path) -> bool:
    """A directory holding ``tokenizer.json``: a transformers / tokenizers tokenizer."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, TOKENIZER_JSON))


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path} is not JSON ({e}); save the tokenizer again with "
                         f"save_pretrained") from None
    return value if isinstance(value, dict) else {}


def special_tokens(directory: Path) -> dict[str, str]:
    """``{"bos_token": ..., "eos_token": ..., "pad_token": ...}`` as the directory names them
    (``tokenizer_config.json`` first, as transformers reads it); absent ones left out."""
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins
        for key, value in _read_json(directory / name).items():
            if key in ("bos_token", "eos_token", "pad_token", "unk_token"):
                content = value.get("content") if isinstance(value, dict) else value
                if isinstance(content, str):
                    found[key] = content
    return found


class HFTokenizer:
    """The interface ``data.tokenizer.Tokenizer`` offers, over a ``tokenizers.Tokenizer``."""

    def __init__(self, backend, model_path: str, specials: dict[str, str]):
        self.backend, self.model_path, self.specials = backend, model_path, specials
        self.bos_id = self.special_id("bos_token")
        self._eos = self.special_id("eos_token")

    @classmethod
    def load(cls, directory: str) -> "HFTokenizer":
        from tokenizers import Tokenizer as Backend

        path = Path(directory)
        if not is_hf_dir(path):
            raise FileNotFoundError(f"{directory} holds no {TOKENIZER_JSON}; save the tokenizer "
                                    f"there with transformers' save_pretrained")
        try:
            backend = Backend.from_file(str(path / TOKENIZER_JSON))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises its own Exception type
            raise ValueError(f"{path / TOKENIZER_JSON} does not load as a tokenizer ({exc}); save "
                             f"it again with save_pretrained") from None
        return cls(backend, str(path), special_tokens(path))

    def special_id(self, key: str) -> int | None:
        """The id of the special token ``key`` names (``"pad_token"``, ...), None without one."""
        token = self.specials.get(key)
        if token is None:
            return None
        i = self.backend.token_to_id(token)
        if i is None:
            raise ValueError(f"{self.model_path}: its {key} {token!r} is not in the vocabulary; "
                             f"fix tokenizer_config.json")
        return i

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eod_id(self) -> int:
        if self._eos is None:
            raise ValueError(f"tokenizer {self.model_path} names no eos_token (the end of a "
                             f"document); set eos_token in its tokenizer_config.json")
        return self._eos

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """One call into the Rust library (which picks its own threads)."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def __getstate__(self):  # picklable for worker processes: the JSON, not the Rust object
        return {"json": self.backend.to_str(), "model_path": self.model_path,
                "specials": self.specials}

    def __setstate__(self, state):
        from tokenizers import Tokenizer as Backend

        self.__init__(Backend.from_str(state["json"]), state["model_path"], state["specials"])


def encoding_digest(directory: str) -> str:
    """SHA-256 of what decides the ids: each encoding file's JSON re-serialised with sorted keys
    and no whitespace (two ``save_pretrained`` of one tokenizer agree whatever their indentation;
    any change of a merge, id, normalizer or special token changes it)."""
    h = hashlib.sha256()
    for name in ENCODING_FILES:
        path = Path(directory) / name
        if path.is_file():
            value = json.loads(path.read_text(encoding="utf-8"))
            if name == "tokenizer_config.json":  # where it was saved from is not how it encodes
                value.pop("name_or_path", None)
            h.update(name.encode() + b"\0")
            h.update(json.dumps(value, sort_keys=True, separators=(",", ":")).encode() + b"\0")
    return h.hexdigest()


def files_sha256(directory: Path) -> str:
    """SHA-256 over the kept files' names and bytes: a checkpoint's copy checked byte for byte."""
    h = hashlib.sha256()
    for name in KEPT_FILES:
        path = Path(directory) / name
        if path.is_file():
            h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def copy_files(source: Path, target: Path, write) -> None:
    """The kept files of ``source`` into the directory ``target``, each by ``write(path, bytes)``
    (the caller's atomic write)."""
    target.mkdir(parents=True, exist_ok=True)
    for name in KEPT_FILES:
        if (Path(source) / name).is_file():
            write(target / name, (Path(source) / name).read_bytes())
