"""The tokenizer a token file was made with, recorded beside it: ``<prefix>.tokenizer.json``.

Why: the ``.idx`` records only a vocabulary size, so token files made by another tokenizer of
the same size -- or a 512-piece file whose header was edited to say 1,024 -- trained without a
word, every id naming another token to the model. Checkpoints already compare tokenizers by
``encoding_digest`` (what decides how a SentencePiece model encodes); token files now carry the
same digest in a small JSON file beside ``.bin/.idx``, so the ``.idx`` itself (and Megatron's
reading of it) is unchanged. A file without the record (older files, Megatron's) is not checked.
"""

from __future__ import annotations

import contextlib
import json
import os

from zerotron.data.atomic import publish, tmp_name

SUFFIX = ".tokenizer.json"


def forget(prefix: str) -> None:
    """Remove ``prefix``'s record before its files are rewritten: never a record of old files."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(prefix + SUFFIX)


def record(prefix: str, model_path: str) -> None:
    """Write the fingerprint of the tokenizer at ``model_path`` beside ``prefix``'s token files."""
    from zerotron.data.tokenizer import encoding_digest

    path = prefix + SUFFIX
    tmp = tmp_name(path)
    with open(tmp, "w") as f:
        json.dump({"tokenizer": os.path.abspath(model_path),
                   "encoding_sha256": encoding_digest(model_path)}, f)
    publish(tmp, path)


def mismatch(prefix: str, model_path: str, digest: str) -> str | None:
    """Why ``prefix``'s token files were not made with the tokenizer at ``model_path`` (naming
    both), or None when they were or when no record exists. ``digest`` is that tokenizer's
    ``encoding_digest``, computed once by the caller for all the run's token files."""
    path = prefix + SUFFIX
    try:
        with open(path) as f:
            rec = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return f"{path} (the record of the tokenizer it was made with) is unreadable ({e})"
    if not isinstance(rec, dict) or not isinstance(rec.get("encoding_sha256"), str):
        return f"{path} (the record of the tokenizer it was made with) is not such a record"
    if rec["encoding_sha256"] == digest:
        return None
    return (f"was tokenized with {rec.get('tokenizer')} (recorded in {path}), which encodes "
            f"otherwise than {model_path}")
