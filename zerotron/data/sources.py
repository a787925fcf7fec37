"""Text input from any Hugging Face ``datasets`` source, with the text field chosen by the user.

Why through ``datasets``: it already reads local text / json / jsonl / parquet / arrow files,
``save_to_disk`` directories and hub names, and its *streaming* mode reads a corpus row by row
without first converting it to an Arrow cache -- the only way to preprocess a corpus larger than
memory or local disk. We add what it lacks for a pretraining job: a clear error for a missing
path, an unknown extension, a missing text field (naming the columns there are), a non-string
value and malformed JSON (naming the file and line, where ``datasets`` names neither), and its
cache in the project's cache directory instead of the home directory.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
from typing import Iterable, Iterator, Sequence

_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json",
             ".parquet": "parquet", ".arrow": "arrow"}
# where the non-streaming reader's Arrow cache goes, next to the built-in corpus (``data.cache_dir``)
# and relative to the working directory like it; HF_DATASETS_CACHE still wins when set
DEFAULT_CACHE_DIR = os.path.join(".cache", "zerotron", "datasets")
_ONE_OBJECT_PER_LINE = 'every line of a JSON-lines file must be one JSON object such as {"text": "..."}'
_ONE_ARRAY = "a .json file that opens with [ must be one JSON array of objects"


class SourceError(ValueError):
    """An input that cannot be read, named with the fix; never rewritten by the readers' wrappers."""


class MissingFieldError(KeyError):
    """The text field is not a column: a ``KeyError`` that prints its message as written (a plain
    ``KeyError`` prints the repr of its argument, quotes and all)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _json_error(e: json.JSONDecodeError) -> str:
    return f"not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno})"


def _looks_local(name: str) -> bool:
    return (os.sep in name and not _is_hub_name(name)) or name.startswith((".", "~")) \
        or os.path.splitext(name)[1].lower() in _BUILDERS


def _is_hub_name(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not os.path.exists(name) and not name.startswith("/")


def _expand(paths: Sequence[str]) -> tuple[str, list[str]]:
    """Files behind ``paths`` (files, directories, globs) and the one builder that reads them."""
    files: list[str] = []
    for p in paths:
        p = os.path.expanduser(str(p))
        if os.path.isdir(p):
            found = sorted(f for f in glob.glob(os.path.join(p, "**", "*"), recursive=True)
                           if os.path.isfile(f) and os.path.splitext(f)[1].lower() in _BUILDERS)
            if not found:
                raise FileNotFoundError(f"directory {p} holds no {'/'.join(sorted(_BUILDERS))} files")
            files += found
        elif any(c in p for c in "*?["):
            found = sorted(glob.glob(p, recursive=True))
            if not found:
                raise FileNotFoundError(f"no file matches {p}")
            files += found
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise FileNotFoundError(f"input {p} does not exist; pass existing files, directories "
                                    f"or globs, or a hub dataset name")
    builders = {_BUILDERS.get(os.path.splitext(f)[1].lower()) for f in files}
    if None in builders:
        bad = next(f for f in files if os.path.splitext(f)[1].lower() not in _BUILDERS)
        raise ValueError(f"cannot tell the format of {bad}; use one of the extensions "
                         f"{', '.join(sorted(_BUILDERS))}")
    if len(builders) > 1:
        raise ValueError(f"inputs mix formats {sorted(builders)}; preprocess each format separately "
                         f"and blend the token files")
    if all(os.path.getsize(f) == 0 for f in files):
        raise SourceError(f"empty corpus: every input file is empty ({', '.join(files[:3])}"
                          f"{', ...' if len(files) > 3 else ''})")
    return builders.pop(), files


def _bad_json_line(path: str) -> tuple[int, str, str] | None:
    """The first line of a JSON(-lines) file that is not a JSON object, why, and the rule it breaks;
    None if there is none.

    Read only after ``datasets`` failed, so a good corpus is never read twice. A file that opens
    with ``[`` is one JSON document (an array of rows); any other is read line by line.
    """
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if head.startswith(b"["):
        try:
            with open(path, encoding="utf-8") as f:
                json.load(f)
        except json.JSONDecodeError as e:
            return e.lineno, _json_error(e), _ONE_ARRAY
        except UnicodeDecodeError as e:
            return 1, f"not UTF-8 text ({e.reason} at byte {e.start} of the file)", _ONE_ARRAY
        return None
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return number, f"not UTF-8 text ({e.reason} at byte {e.start} of the line)", _ONE_OBJECT_PER_LINE
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                return number, _json_error(e), _ONE_OBJECT_PER_LINE
            if not isinstance(row, dict):
                return number, f"a JSON {type(row).__name__}, not an object", _ONE_OBJECT_PER_LINE
    return None


def _bad_text_line(path: str) -> tuple[int, str] | None:
    """``(line number, why)`` of a plain-text file's first line that is not UTF-8, else None."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return number, f"not UTF-8 text ({e.reason} at byte {e.start} of the line)"
    return None


def _read_error(files: Sequence[str], names: Sequence[str], exc: BaseException) -> SourceError:
    """What ``datasets`` raised, as an error naming the file, the line and the fix."""
    for path in files:
        if os.path.splitext(path)[1].lower() in (".txt", ".text"):
            bad = _bad_text_line(path)
            if bad is not None:  # not a --text-field matter: the bytes are not text
                return SourceError(f"{path}:{bad[0]}: {bad[1]}; convert the file to UTF-8 (e.g. "
                                   f"iconv -f latin1 -t utf-8) or fix that line")
    for path in files:
        if os.path.splitext(path)[1].lower() in (".json", ".jsonl"):
            bad = _bad_json_line(path)
            if bad is not None:
                return SourceError(f"{path}:{bad[0]}: {bad[1]}; {bad[2]}: fix or delete that line")
    cause = exc
    while cause.__cause__ is not None or cause.__context__ is not None:  # datasets wraps the reader's error
        cause = cause.__cause__ or cause.__context__
    if "corresponds to no data" in str(exc):  # datasets' words for a split without one row
        return SourceError(f"{', '.join(names)} holds no rows (empty, or only blank lines): nothing to read; "
                           f"check the files")
    return SourceError(f"cannot read {', '.join(names)}: {type(cause).__name__}: {cause}; every row must hold the "
                       f"same fields with the same types -- fix the rows or pick another --text-field")


@contextlib.contextmanager
def _quiet_reader_logs():
    """``datasets`` logs a reader's failure with a full traceback before it raises; the error raised
    instead names the file and the line, so that log would only bury it."""
    log = logging.getLogger("datasets.packaged_modules")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _reader_errors():
    """The exceptions by which ``datasets`` and the readers under it (Arrow, pandas, json) report an
    unreadable input file; a ``SourceError`` among them is already ours and passes unchanged."""
    import datasets
    import pyarrow

    return (datasets.exceptions.DatasetGenerationError, pyarrow.ArrowException, ValueError)


def load_source(inputs: str | Sequence[str], text_field: str = "text", streaming: bool = False,
                split: str = "train", cache_dir: str | None = None):
    """Open ``inputs`` as a ``datasets`` Dataset (or IterableDataset when ``streaming``).

    ``inputs``: file(s), directory(ies) or globs of one format; a ``save_to_disk`` directory; or
    a hub name (needs a network). ``.txt`` files give one document per file (read with universal newlines, as
    ``datasets`` does: ``\r\n`` becomes ``\n``). The text field is
    checked here so a typo fails in a second, not after an hour of tokenizing. ``cache_dir``:
    None is ``$HF_DATASETS_CACHE`` when set, else ``DEFAULT_CACHE_DIR``. The dataset carries
    ``zerotron_files``, its local files, so ``iter_texts`` can name the line a streaming read
    fails on.
    """
    import datasets

    cache_dir = cache_dir or os.environ.get("HF_DATASETS_CACHE") or DEFAULT_CACHE_DIR
    names = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    if not names:
        raise ValueError("no input given; pass at least one file, directory or hub name")
    names = [str(n) for n in names]
    first = os.path.expanduser(names[0])
    files: list[str] = []
    if len(names) == 1 and os.path.isdir(first) and (
            os.path.isfile(os.path.join(first, "state.json"))
            or os.path.isfile(os.path.join(first, "dataset_dict.json"))):
        ds = datasets.load_from_disk(first)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[split]
        if streaming:
            ds = ds.to_iterable_dataset()
    elif len(names) == 1 and not os.path.exists(first) and not _looks_local(names[0]):
        try:
            ds = datasets.load_dataset(names[0], split=split, streaming=streaming, cache_dir=cache_dir)
        except Exception as exc:  # the Hub's own errors: offline, no such dataset, no such split
            raise SourceError(f"{names[0]}: no such local file or directory, and the Hugging Face Hub did not "
                              f"give it ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                              f"check the path (a file needs its extension: {', '.join(sorted(_BUILDERS))}), "
                              f"or the dataset's name, split and access (a gated one needs a Hub login)") from None
    else:
        if split != "train":
            raise SourceError(f"--split {split}: local files are one split; the split selects within a hub "
                              f"dataset or a save_to_disk directory, so name the files of that split instead")
        builder, files = _expand(names)
        kwargs = {"sample_by": "document"} if builder == "text" else {}
        try:
            with _quiet_reader_logs():
                ds = datasets.load_dataset(builder, data_files=files, split="train", streaming=streaming,
                                           cache_dir=cache_dir, **kwargs)
        except SourceError:
            raise
        except _reader_errors() as exc:
            raise _read_error(files, names, exc) from None
    ds.zerotron_files = files
    try:
        with _quiet_reader_logs():
            check_text_field(ds, text_field, names)  # a streaming source reads its first row here
    except SourceError:
        raise
    except _reader_errors() as exc:
        if not files:
            raise
        raise _read_error(files, names, exc) from None
    return ds


def check_text_field(ds, text_field: str, names: Sequence[str] = ()) -> None:
    """Raise ``MissingFieldError`` naming the columns that exist when ``text_field`` is not one of them."""
    columns = ds.column_names
    if not columns:  # streaming source without declared features (or none, from blank lines): peek at one row
        row = next(iter(ds), None)
        if row is None:
            raise SourceError(f"empty corpus: {', '.join(names) or 'the input'} has no rows")
        columns = list(row)
    if text_field not in columns:
        raise MissingFieldError(f"text field {text_field!r} not found in {', '.join(names) or 'the input'}; "
                       f"its columns are {columns}; pass --text-field with one of them")


def iter_texts(ds, text_field: str = "text", batch_size: int = 1000) -> Iterator[str]:
    """Yield the text of every row, in order; a non-string value is an error naming its row, and
    a file that fails mid-read (streaming) one naming its file and line."""
    files = getattr(ds, "zerotron_files", None)
    texts = _iter_texts(ds, text_field, batch_size)
    if not files:
        yield from texts
        return
    try:
        with _quiet_reader_logs():
            yield from texts
    except SourceError:
        raise
    except _reader_errors() as exc:
        raise _read_error(files, files, exc) from None


def _iter_texts(ds, text_field: str, batch_size: int) -> Iterator[str]:
    if hasattr(ds, "iter"):
        batches: Iterable = ds.select_columns([text_field]).iter(batch_size=batch_size)
    else:
        batches = ({text_field: [row[text_field]]} for row in ds)
    row = 0
    files = getattr(ds, "zerotron_files", None)
    where = f" of {', '.join(files)}" if files else ""
    for batch in batches:
        for text in batch[text_field]:
            if not isinstance(text, str):  # rows counted from 1, as a JSON Lines file's lines are
                raise TypeError(f"row {row + 1}{where} (counting from 1): text field "
                                f"{text_field!r} holds {type(text).__name__}, not a string; choose a "
                                f"text column with --text-field")
            row += 1
            yield text


def known_rows(ds) -> int | None:
    """Rows of ``ds`` when known without reading it (a Dataset's length, a streaming hub dataset's
    split info), so progress can show a total and an ETA; None for a local streaming source."""
    if hasattr(ds, "__len__"):
        return len(ds)
    split = getattr(ds, "split", None)
    splits = getattr(getattr(ds, "info", None), "splits", None) or {}
    info = splits.get(str(split)) if split is not None else None
    return int(info.num_examples) if info is not None and info.num_examples else None
