"""Any ``datasets`` input (json/jsonl/parquet/arrow/text files, directories, save_to_disk, streaming)
gives the same texts; bad input fails with a clear error and the scripts write no output."""

from __future__ import annotations

import json
import re
import os
import sys

import pytest

from zerotron.data import IndexedTokenDataset, iter_texts, load_source
from zerotron.data.sources import SourceError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import preprocess_data  # noqa: E402
import train_tokenizer  # noqa: E402


def _jsonl(path, texts, field="content"):
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": i, field: t}) + "\n")
    return str(path)


@pytest.mark.parametrize("streaming", [False, True])
def test_formats_agree(tmp_path, corpus, streaming):
    import datasets
    src = _jsonl(tmp_path / "c.jsonl", corpus)
    table = datasets.Dataset.from_dict({"content": corpus})
    table.to_parquet(str(tmp_path / "c.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    txt = tmp_path / "txt"
    txt.mkdir()
    for i, t in enumerate(corpus[:5]):
        (txt / f"{i}.txt").write_text(t, encoding="utf-8")
    cache = str(tmp_path / "hf")
    for inputs in (src, [src], str(tmp_path / "c.parquet"), str(tmp_path / "saved")):
        ds = load_source(inputs, "content", streaming=streaming, cache_dir=cache)
        assert list(iter_texts(ds, "content")) == corpus
    ds = load_source(str(txt), "text", streaming=streaming, cache_dir=cache)  # one document per file
    # datasets' text reader uses universal newlines: "\r\n" in a .txt file arrives as "\n"
    assert list(iter_texts(ds, "text")) == [t.replace("\r\n", "\n") for t in corpus[:5]]


def test_bad_sources(tmp_path, corpus):
    with pytest.raises(FileNotFoundError, match="missing.jsonl does not exist"):
        load_source(str(tmp_path / "missing.jsonl"))
    src = _jsonl(tmp_path / "c.jsonl", corpus)
    for streaming in (False, True):
        with pytest.raises(KeyError, match=r"text field 'text' not found .*\['id', 'content'\].*--text-field"):
            load_source(src, "text", streaming=streaming, cache_dir=str(tmp_path / "hf"))
    ds = load_source(src, "id", cache_dir=str(tmp_path / "hf"))
    want = f"row 1 of {src} (counting from 1): text field 'id' holds int"
    with pytest.raises(TypeError, match=re.escape(want)):
        list(iter_texts(ds, "id"))
    (tmp_path / "x.csvx").write_text("a")
    with pytest.raises(ValueError, match="cannot tell the format"):
        load_source([src, str(tmp_path / "x.csvx")])


def test_scripts_end_to_end_and_errors(tmp_path, corpus, capsys):
    src = _jsonl(tmp_path / "c.jsonl", corpus)
    tok_prefix = str(tmp_path / "tok")
    assert train_tokenizer.main([src, "--text-field", "content", "--model-prefix", tok_prefix,
                                 "--vocab-size", "400"]) == 0
    out = str(tmp_path / "out" / "c")
    for streaming in ([], ["--streaming"]):
        rc = preprocess_data.main([src, "--text-field", "content", "--tokenizer", tok_prefix + ".model",
                                   "--output-prefix", out, "--workers", "2", "--no-progress", *streaming])
        assert rc == 0
        assert len(IndexedTokenDataset(out)) == len(corpus)
    assert "tokens/s; peak RSS" in capsys.readouterr().out
    bad = str(tmp_path / "bad" / "c")
    base = ["--tokenizer", tok_prefix + ".model", "--output-prefix", bad, "--no-progress"]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    only_empty = _jsonl(tmp_path / "e.jsonl", ["", ""], field="text")
    cases = [([str(tmp_path / "nope.jsonl")], "does not exist"),
             ([src, "--text-field", "body"], "text field 'body' not found"),
             ([only_empty, "--streaming"], "empty corpus"),
             ([str(empty), "--streaming"], "empty corpus"),
             ([src, "--text-field", "content", "--tokenizer", str(tmp_path / "no.model")], "no.model does not exist"),
             ([src, "--text-field", "content", "--tokenizer", str(tmp_path)], "is a directory without tokenizer.json; name a SentencePiece .model file")]
    for args, msg in cases:
        assert preprocess_data.main(args + base if "--tokenizer" not in args else args + base[2:]) == 2
        assert msg in capsys.readouterr().err
        assert not os.path.exists(tmp_path / "bad") or os.listdir(tmp_path / "bad") == []


def test_script_arguments_that_cannot_work_exit_2_before_any_work(tmp_path, corpus, capsys, monkeypatch):
    """Output prefixes that name a directory or lie under a file, sizes below 1, a split of local
    files, a name that is neither a local file nor reachable on the Hub: exit 2 naming the flag,
    and nothing written."""
    import datasets
    import huggingface_hub

    # offline, as this suite runs: the Hub lookup fails at once (the variable is read at import)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # "corpus/c.jsonl.typo" is relative, and so read as a hub name too
    src = _jsonl(tmp_path / "c.jsonl", corpus)
    (tmp_path / "afile").write_text("x")
    tok = ["--text-field", "content", "--vocab-size", "400"]
    tok_cases = [
        ([src, *tok, "--model-prefix", str(tmp_path / "out") + "/"], "--model-prefix", "names a directory"),
        ([src, *tok, "--model-prefix", str(tmp_path / "afile" / "t")], "--model-prefix", "is a file, not a directory"),
        ([src, *tok, "--model-prefix", str(tmp_path / "t"), "--split", "validation"], "--split validation",
         "local files are one split"),
        (["corpus/c.jsonl.typo", *tok, "--model-prefix", str(tmp_path / "t")], "corpus/c.jsonl.typo",
         "no such local file or directory, and the Hugging Face Hub did not give it"),
    ]
    for argv, flag, needle in tok_cases:
        assert train_tokenizer.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert flag in err and needle in err, (argv, err)
    for flag in (["--vocab-size", "0"], ["--threads", "0"], ["--max-documents", "-3"]):
        with pytest.raises(SystemExit) as e:
            train_tokenizer.main([src, "--text-field", "content", "--model-prefix", str(tmp_path / "t"),
                                  "--vocab-size", "400", *flag])
        assert e.value.code == 2 and f"{flag[0]} must be >= 1" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["afile", "c.jsonl"]
    with pytest.raises(SystemExit) as e:
        preprocess_data.main([src, "--tokenizer", "t.model", "--output-prefix", "o", "--batch-size", "0"])
    assert e.value.code == 2 and "--batch-size must be >= 1" in capsys.readouterr().err
    assert preprocess_data.main([src, "--text-field", "content", "--tokenizer", "t.model",
                                 "--output-prefix", str(tmp_path / "afile" / "o")]) == 2
    assert "--output-prefix" in capsys.readouterr().err


def test_a_file_of_blank_lines_is_an_empty_corpus_streaming_or_not(tmp_path, capsys, zerotron_cache):
    from zerotron.data import build_default_corpus

    tokenizer = build_default_corpus(zerotron_cache)[1]
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n\n")
    assert train_tokenizer.main([str(blank), "--model-prefix", str(tmp_path / "t"), "--vocab-size", "400"]) == 2
    assert "empty corpus" in capsys.readouterr().err
    assert preprocess_data.main([str(blank), "--tokenizer", tokenizer, "--output-prefix", str(tmp_path / "o")]) == 2
    assert "blank.jsonl holds no rows (empty, or only blank lines)" in capsys.readouterr().err


def test_a_missing_text_field_prints_as_written(tmp_path, corpus, capsys):
    src = _jsonl(tmp_path / "c.jsonl", corpus)
    assert train_tokenizer.main([src, "--text-field", "body", "--model-prefix", str(tmp_path / "t"),
                                 "--vocab-size", "400"]) == 2
    assert capsys.readouterr().err.startswith("error: text field 'body' not found")  # not a KeyError's repr


@pytest.mark.parametrize("streaming", [False, True])
def test_a_txt_file_not_utf8_is_named_with_its_line_not_blamed_on_the_field(tmp_path, streaming):
    txt = tmp_path / "latin1.txt"
    txt.write_bytes("first line\nsecond line\ncaf\xe9 au lait\n".encode("latin1"))
    with pytest.raises(SourceError) as err:
        ds = load_source(str(txt), "text", streaming=streaming, cache_dir=str(tmp_path / "hf"))
        list(iter_texts(ds, "text"))
    text = str(err.value)
    assert f"{txt}:3: not UTF-8 text" in text and "--text-field" not in text, text
