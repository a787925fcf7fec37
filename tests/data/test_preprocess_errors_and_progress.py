"""Preprocessing as a user meets it: malformed JSON is named by file and line with both readers,
``datasets`` caches inside the project, and progress reads as lines (total, ETA) off a terminal."""

from __future__ import annotations

import io
import json
import os
import re
import sys

import pytest

from zerotron.data import load_source
from zerotron.data.progress import Progress
from zerotron.data.sources import DEFAULT_CACHE_DIR

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import preprocess_data  # noqa: E402


@pytest.fixture
def tokenizer_model(tokenizer) -> str:
    return tokenizer.model_path


BAD_FILES = {  # name, content, the line and the words the error must carry
    "control.jsonl": ('{"text": "a"}\n{"text": "b"}\n{"text": "c\n', 3, "not valid JSON"),
    "list.jsonl": ('{"text": "a"}\n[1, 2]\n', 2, "a JSON list, not an object"),
    "latin1.jsonl": (b'{"text": "a"}\n{"text": "caf\xe9"}\n', 2, "not UTF-8 text"),
    "array.json": ('[{"text": "a"},\n{"text": "b"\n]\n', 3, "must be one JSON array"),
}


@pytest.mark.parametrize("streaming", [[], ["--streaming"]], ids=["arrow", "streaming"])
@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_json_names_file_line_and_fix_with_both_readers(tmp_path, tokenizer_model, capsys, name, streaming):
    content, line, words = BAD_FILES[name]
    good, bad = tmp_path / "good.jsonl", tmp_path / name
    good.write_text(json.dumps({"text": "fine"}) + "\n")
    bad.write_bytes(content if isinstance(content, bytes) else content.encode())
    out = tmp_path / "out" / "c"
    rc = preprocess_data.main([str(good), str(bad), "--tokenizer", tokenizer_model, "--output-prefix", str(out),
                               "--workers", "1", "--no-progress", *streaming])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"{bad}:{line}: " in err and words in err and "fix or delete that line" in err, err
    assert "Traceback" not in err and "DatasetGenerationError" not in err
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []


def test_datasets_cache_defaults_to_the_project_cache_dir(tmp_path, monkeypatch, corpus):
    monkeypatch.delenv("HF_DATASETS_CACHE")
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus[:3]))
    ds = load_source(str(src))
    cached = ds.cache_files[0]["filename"]
    assert cached.startswith(str(tmp_path / DEFAULT_CACHE_DIR) + os.sep), cached


def test_progress_off_a_terminal_prints_lines_with_total_and_eta():
    stream = io.StringIO()  # not a TTY: line mode
    bar = Progress("tokenizing -> x", total=400, unit="doc", interval=0.0, stream=stream)
    for _ in range(4):
        bar.update(100, tokens=2500)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4 and "\r" not in stream.getvalue()  # close() does not repeat the last line
    assert re.match(r"tokenizing -> x: 100/400 doc \(25\.0%\), .* doc/s, .* tok/s, 0:00 elapsed, ETA \d+:\d\d$",
                    lines[0]), lines[0]
    assert "400/400 doc (100.0%)" in lines[-1] and lines[-1].endswith("ETA 0:00")
    unknown = io.StringIO()
    bar = Progress("streaming", total=None, interval=0.0, stream=unknown)
    bar.update(7)
    assert "7 doc," in unknown.getvalue() and "ETA" not in unknown.getvalue()  # no total, no made-up ETA


def test_preprocess_without_streaming_reports_progress_against_the_total(tmp_path, tokenizer_model, corpus, capsys):
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus))
    assert preprocess_data.main([str(src), "--tokenizer", tokenizer_model, "--output-prefix",
                                 str(tmp_path / "out" / "c"), "--workers", "1"]) == 0
    err = capsys.readouterr().err  # captured: not a terminal, so the progress is plain lines
    progress = [line for line in err.splitlines() if line.startswith("tokenizing -> ")]
    n = len(corpus)
    assert progress and f"{n}/{n} doc (100.0%)" in progress[-1] and "ETA 0:00" in progress[-1], err
