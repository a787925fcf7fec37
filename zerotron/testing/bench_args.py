"""Flag checks shared by the benchmarks and checks under ``scripts/bench`` and ``scripts/checks``.

A bad size reaching the ranks fails there as a traceback from one of N forked processes -- or
as a collective waiting on a rank that died of it. These checks run in the parent, at parse
time, so the script exits 2 (argparse's usage error) with a message naming the flag and the fix
before any process is started. ``flag_errors`` renames the library's config fields in its
``ValueError`` (``model.hidden_size``, ``zero.sub_group_size``) to the flags that set them, so the
constraint checked is the library's own (``GPTConfig.validate``, ``ZeroConfig.validate``), not a
copy kept here.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from contextlib import contextmanager
from typing import Iterator


def _number(text: str, kind: type, low: float, strict: bool, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if not math.isfinite(value) or value < low or (strict and value == low):
        raise argparse.ArgumentTypeError(f"{text} is not {what}")
    return value


def positive_int(text: str) -> int:
    """argparse ``type``: an integer >= 1 (a count or a size)."""
    return _number(text, int, 1, False, "a positive integer (at least 1)")


def nonnegative_int(text: str) -> int:
    """argparse ``type``: an integer >= 0 (a count where 0 means none)."""
    return _number(text, int, 0, False, "an integer >= 0")


def positive_float(text: str) -> float:
    """argparse ``type``: a finite number > 0 (a size or a duration)."""
    return _number(text, float, 0.0, True, "a finite number > 0")


def nonnegative_float(text: str) -> float:
    """argparse ``type``: a finite number >= 0 (0 switches the feature off)."""
    return _number(text, float, 0.0, False, "a finite number >= 0")


def rename_fields(message: str, flags: dict[str, str]) -> str:
    """``message`` with each config field (``model.hidden_size``, ``parallel.tp``, or bare
    ``hidden_size`` in the fix it suggests) replaced by the flag that sets it."""
    for field in sorted(flags, key=len, reverse=True):
        message = re.sub(rf"\b(?:model\.|parallel\.|zero\.)?{re.escape(field)}\b", flags[field], message)
    return message


@contextmanager
def flag_errors(parser: argparse.ArgumentParser, flags: dict[str, str], note: str = "") -> Iterator[None]:
    """A ``ValueError`` raised inside becomes ``parser.error`` (exit 2), its fields named by
    ``flags`` (field -> flag); ``note`` says what the script fixes that no flag sets."""
    try:
        yield
    except ValueError as e:
        parser.error(rename_fields(str(e), flags) + (f" ({note})" if note else ""))


GPT_FLAGS = {"num_layers": "--layers", "hidden_size": "--hidden", "num_heads": "--heads", "seq_length": "--seq",
             "vocab_size": "--vocab"}


def add_gpt_flags(parser: argparse.ArgumentParser, *, layers: int, hidden: int, vocab: int, seq: int,
                  min_heads: int = 1) -> None:
    """The measured GPT's shape flags, with this script's defaults; ``--heads`` defaults to
    ``hidden / 64`` (at least ``min_heads``), the head size of the GPT-2 family."""
    parser.add_argument("--layers", type=positive_int, default=layers)
    parser.add_argument("--hidden", type=positive_int, default=hidden)
    parser.add_argument("--heads", type=positive_int, default=None,
                        help=f"attention heads (default: hidden / 64, at least {min_heads})")
    parser.add_argument("--vocab", type=positive_int, default=vocab)
    parser.add_argument("--seq", type=positive_int, default=seq)
    parser.set_defaults(min_heads=min_heads)


def gpt_config(args):
    """The ``GPTConfig`` of ``add_gpt_flags``' flags (in a rank too: ``args`` travels with it)."""
    from zerotron.model.config import GPTConfig

    return GPTConfig(num_layers=args.layers, hidden_size=args.hidden, vocab_size=args.vocab, seq_length=args.seq,
                     num_heads=args.heads or max(args.min_heads, args.hidden // 64))


def check_gpt(parser: argparse.ArgumentParser, args, tp: int = 1, note: str = "") -> None:
    """Exit 2 naming the flags where ``GPTConfig.validate`` refuses the shape at TP ``tp``."""
    notes = [n for n in (note, "" if args.heads else "--heads defaults to --hidden // 64") if n]
    with flag_errors(parser, GPT_FLAGS, note="; ".join(notes)):
        gpt_config(args).validate(tp)


def check_out_dir(parser: argparse.ArgumentParser, flag: str, path: str | None, holds: str) -> None:
    """Exit 2 (``parser.error``) unless ``path`` is a directory this process can write in, or one it
    can create: judged at the nearest part of it that exists, so a file anywhere on the way is named
    before a rank starts, not met as a traceback from ``mkdir`` inside one."""
    from zerotron.data.atomic import nearest_existing, write_probe

    if path is None:
        return
    where = nearest_existing(path)
    if not os.path.isdir(where):
        parser.error(f"{flag} {path}: not a directory ({where} is a file); name a directory (made if missing) "
                     f"for {holds}")
    problem = write_probe(where)
    if problem is not None:
        parser.error(f"{flag} {path}: cannot write in {where} ({problem}); name a writable directory for {holds}")
