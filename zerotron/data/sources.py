"""Text input from any Hugging Face ``datasets`` source, with the text field chosen by the user.

Why through ``datasets``: it already reads local text / json / jsonl / parquet / arrow files,
``save_to_disk`` directories and hub names, and its *streaming* mode reads a corpus row by row
without first converting it to an Arrow cache -- the only way to preprocess a corpus larger than
memory or local disk. We add what it lacks for a pretraining job: a clear error for a missing
path, an unknown extension, a missing text field (naming the columns there are) and a non-string
value, raised before any output is written.
"""

from __future__ import annotations

import glob
import os
from typing import Iterable, Iterator, Sequence

_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json",
             ".parquet": "parquet", ".arrow": "arrow"}


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
        raise ValueError(f"empty corpus: every input file is empty ({', '.join(files[:3])}"
                         f"{', ...' if len(files) > 3 else ''})")
    return builders.pop(), files


def load_source(inputs: str | Sequence[str], text_field: str = "text", streaming: bool = False,
                split: str = "train", cache_dir: str | None = None):
    """Open ``inputs`` as a ``datasets`` Dataset (or IterableDataset when ``streaming``).

    ``inputs``: file(s), directory(ies) or globs of one format; a ``save_to_disk`` directory; or
    a hub name (needs a network). ``.txt`` files give one document per file (read with universal newlines, as
    ``datasets`` does: ``\r\n`` becomes ``\n``). The text field is
    checked here so a typo fails in a second, not after an hour of tokenizing.
    """
    import datasets

    names = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    if not names:
        raise ValueError("no input given; pass at least one file, directory or hub name")
    names = [str(n) for n in names]
    first = os.path.expanduser(names[0])
    if len(names) == 1 and os.path.isdir(first) and (
            os.path.isfile(os.path.join(first, "state.json"))
            or os.path.isfile(os.path.join(first, "dataset_dict.json"))):
        ds = datasets.load_from_disk(first)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[split]
        if streaming:
            ds = ds.to_iterable_dataset()
    elif len(names) == 1 and not os.path.exists(first) and not _looks_local(names[0]):
        ds = datasets.load_dataset(names[0], split=split, streaming=streaming, cache_dir=cache_dir)
    else:
        builder, files = _expand(names)
        kwargs = {"sample_by": "document"} if builder == "text" else {}
        ds = datasets.load_dataset(builder, data_files=files, split="train", streaming=streaming,
                                   cache_dir=cache_dir, **kwargs)
    check_text_field(ds, text_field, names)
    return ds


def check_text_field(ds, text_field: str, names: Sequence[str] = ()) -> None:
    """Raise KeyError naming the columns that exist when ``text_field`` is not one of them."""
    columns = ds.column_names
    if columns is None:  # streaming source without declared features: peek at one row
        row = next(iter(ds), None)
        if row is None:
            raise ValueError(f"empty corpus: {', '.join(names) or 'the input'} has no rows")
        columns = list(row)
    if text_field not in columns:
        raise KeyError(f"text field {text_field!r} not found in {', '.join(names) or 'the input'}; "
                       f"its columns are {columns}; pass --text-field with one of them")


def iter_texts(ds, text_field: str = "text", batch_size: int = 1000) -> Iterator[str]:
    """Yield the text of every row, in order; a non-string value is an error naming its row."""
    if hasattr(ds, "iter"):
        batches: Iterable = ds.select_columns([text_field]).iter(batch_size=batch_size)
    else:
        batches = ({text_field: [row[text_field]]} for row in ds)
    row = 0
    for batch in batches:
        for text in batch[text_field]:
            if not isinstance(text, str):
                raise TypeError(f"row {row}: text field {text_field!r} holds "
                                f"{type(text).__name__}, not a string; choose a text column with "
                                f"--text-field")
            row += 1
            yield text
