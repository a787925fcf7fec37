"""The embedded default corpus: Python standard-library docstrings and comments, built locally.

Why: the main job must run on a cluster with no download, yet train on real English rather
than random tokens (so loss curves mean something). Every machine that runs zerotron already has
the Python standard library -- about 1.6 MB of docstrings plus 0.7 MB of comment blocks of
English technical prose. We read them with ``ast`` (no module is imported, so no side effects),
dedup, split off a small held-out eval set, train a SentencePiece tokenizer on the train split
(or take the run's own, e.g. a Hugging Face model's whose pretraining continues), and write both
splits as token files. Everything is built in a temporary directory and renamed
into place, so a concurrent or interrupted build leaves nothing partial, and a second call
returns at once. The cache key includes the Python version, whose stdlib defines the corpus.
"""

from __future__ import annotations

import ast
import os
import sys
import sysconfig
import warnings

import numpy as np

from zerotron.data.atomic import atomic_dir
from zerotron.data.indexed import IndexedTokenWriter
from zerotron.data import fingerprint
from zerotron.data.tokenizer import Tokenizer, document_ids, encoding_digest, train_tokenizer

CORPUS_VERSION = 1
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
              "ensurepip", "turtledemo", "lib2to3"}
_MIN_CHARS = 40  # one-line docstrings such as "Return self." teach little and repeat a lot


def _stdlib_files() -> list[str]:
    root = sysconfig.get_paths().get("stdlib")
    if not root or not os.path.isdir(root):
        raise FileNotFoundError(f"the Python standard library source is not at {root!r}; the "
                                f"default corpus needs it -- pass your own token files instead")
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS)
        files += [os.path.join(d, n) for n in sorted(names) if n.endswith(".py")]
    return files


def _comment_blocks(source: str) -> list[str]:
    """Runs of two or more full-line comments, joined: the stdlib's explanatory prose."""
    blocks, cur = [], []
    for line in source.splitlines() + [""]:
        s = line.strip()
        if s.startswith("#") and not s.startswith("#!"):
            cur.append(s.lstrip("#").strip())
            continue
        if len(cur) >= 2:
            blocks.append("\n".join(cur).strip())
        cur = []
    return blocks


def harvest_stdlib_texts() -> list[str]:
    """Deduplicated docstrings and comment blocks of the stdlib, in a deterministic order."""
    seen: dict[str, None] = {}
    for path in _stdlib_files():
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # e.g. deliberately broken files; the corpus does not need them
        texts = [ast.get_docstring(n) for n in ast.walk(tree)
                 if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        for t in [t for t in texts if t] + _comment_blocks(source):
            if len(t) >= _MIN_CHARS:
                seen.setdefault(t, None)
    return list(seen)


def build_default_corpus(cache_dir: str, vocab_size: int = 1024, seed: int = 1234,
                         eval_fraction: float = 0.02, tokenizer: str | None = None
                         ) -> tuple[str, str, str]:
    """Return ``(train_prefix, tokenizer_path, eval_prefix)``, building them once.

    ``tokenizer``: encode with that one (a ``.model`` or a Hugging Face tokenizer directory, e.g.
    the model's whose pretraining continues) instead of training one of ``vocab_size`` pieces;
    its encoding digest is in the cache key, and the token files record it (``fingerprint``).
    """
    version = f"py{sys.version_info[0]}{sys.version_info[1]}"
    if tokenizer is None:
        key = f"stdlib-{version}-v{vocab_size}-seed{seed}-c{CORPUS_VERSION}"
    else:
        digest = encoding_digest(tokenizer)[:16]
        key = f"stdlib-{version}-tok{digest}-seed{seed}-c{CORPUS_VERSION}"
    final = os.path.join(os.path.abspath(cache_dir), key)
    tok_path = tokenizer or os.path.join(final, "tokenizer.model")
    paths = (os.path.join(final, "train"), tok_path, os.path.join(final, "eval"))
    if os.path.isdir(final):
        return paths
    tok = Tokenizer.load(tokenizer) if tokenizer else None  # a bad one fails before the harvest
    texts = harvest_stdlib_texts()
    if len(texts) < 100:
        raise ValueError(f"only {len(texts)} documents found in the standard library; the default "
                         f"corpus needs the stdlib .py sources -- pass your own token files instead")
    order = np.random.default_rng(seed).permutation(len(texts))
    n_eval = max(1, int(len(texts) * eval_fraction))
    eval_texts = [texts[i] for i in order[:n_eval]]
    train_texts = [texts[i] for i in order[n_eval:]]
    with atomic_dir(final) as tmp:
        if tok is None:
            tok = train_tokenizer(train_texts, os.path.join(tmp, "tokenizer"), vocab_size)
        for name, split in (("train", train_texts), ("eval", eval_texts)):
            with IndexedTokenWriter(os.path.join(tmp, name), tok.vocab_size) as w:
                for ids in tok.encode_batch(split, num_threads=2):
                    w.add_document(document_ids(tok, ids))
            if tokenizer:  # the files say which tokenizer made them (a trained one lies beside)
                fingerprint.record(os.path.join(tmp, name), tokenizer)
    return paths
