"""A Hugging Face export is usable as it stands: its tokenizer is zerotron's, generate stops at EOD.

The reference is zerotron's own tokenizer (the built-in corpus's) on 50 held-out documents: the
exported ``AutoTokenizer`` must give the very same ids and decode them back to the text. Generation
is driven to the end-of-document id by a logits processor, so the check that ``generate`` stops
there does not depend on how far a few training steps got; nothing tells ``generate`` the id but
the exported files. Every transformers log record and warning is collected
while loading and generating: the ids the export writes must raise none.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.harness import spawn
from tests.training.test_trainer import run_steps
from zerotron.checkpoint.schema import seal
from zerotron.data.tokenizer import BOS_ID

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import convert_checkpoint  # noqa: E402

DOCS = 50


def export_and_check(checkpoint: str, out: str, cache: str) -> dict:
    """``convert_checkpoint.py --hf``, then the exported directory through transformers' own loaders.

    Runs in a forked rank: transformers' threads must not start in the pytest process."""
    import logging
    import warnings

    import torch
    from transformers import AutoTokenizer, GPT2LMHeadModel, LogitsProcessor, LogitsProcessorList

    from zerotron.data import IndexedTokenDataset, Tokenizer, build_default_corpus

    if convert_checkpoint.main([checkpoint, "--hf", out]) != 0:
        return {"exit": "convert_checkpoint.py --hf failed"}

    _, tok_path, eval_prefix = build_default_corpus(cache)  # already built: returns the paths at once
    ours = Tokenizer.load(tok_path)
    held_out = IndexedTokenDataset(eval_prefix)
    docs = [ours.decode(held_out.get(i)[:-1]) for i in range(DOCS)]  # each document ends with EOD

    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(f"{record.name}: {record.getMessage()}")

    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(Collect(logging.WARNING))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        theirs = AutoTokenizer.from_pretrained(out)
        # verbose=False: whole documents are longer than the test model's 32 positions, which is worth a
        # warning in use, not here
        mismatched = [i for i, d in enumerate(docs) if theirs(d, verbose=False)["input_ids"] != ours.encode(d)]
        undecoded = [i for i, d in enumerate(docs) if theirs.decode(ours.encode(d)) != d]
        model = GPT2LMHeadModel.from_pretrained(out).eval()
        eod, forced_at = ours.eod_id, 3

        class EodAt(LogitsProcessor):  # the model picks its own tokens until the forced_at-th new one
            def __init__(self, prompt_len):
                self.prompt_len = prompt_len

            def __call__(self, input_ids, scores):
                if input_ids.shape[1] - self.prompt_len == forced_at:
                    scores[:] = -float("inf")
                    scores[:, eod] = 0.0
                else:
                    scores[:, eod] = -float("inf")
                return scores

        prompts = theirs([docs[0][:12], docs[1][:30]], return_tensors="pt", padding=True)  # two lengths: padded
        prompt_len = prompts["input_ids"].shape[1]
        with torch.no_grad():
            gen = model.generate(**prompts, max_new_tokens=8, do_sample=False,
                                 logits_processor=LogitsProcessorList([EodAt(prompt_len)]))
    records += [f"{w.category.__name__}: {w.message}" for w in caught]
    return {"mismatched": mismatched, "undecoded": undecoded, "docs": len(docs), "eod": eod,
            "new_tokens": gen[:, prompt_len:].tolist(), "generation_eos": model.generation_config.eos_token_id,
            "pad": theirs.pad_token_id, "records": records}


@pytest.fixture(scope="module")
def checkpoint(zerotron_cache, tmp_path_factory) -> Path:
    """Two steps of the tiny GPT on the built-in corpus, saved: weights off their init, tokenizer kept."""
    tmp = tmp_path_factory.mktemp("hf_export")
    spawn(run_steps, 1, tmp / "run", zerotron_cache, 2, ["--save", tmp / "ck", "--save-interval", "2"], timeout=120)
    return tmp / "ck" / "step_00000002"


def test_hf_export_tokenizer_round_trips_and_generate_stops_at_eod(checkpoint, zerotron_cache, tmp_path):
    from zerotron.data import build_default_corpus

    tok_path = Path(build_default_corpus(zerotron_cache)[1])
    meta = json.loads((checkpoint / "metadata.json").read_text())
    assert meta["tokenizer"]["path"] == str(tok_path.resolve())
    assert (checkpoint / meta["tokenizer"]["file"]).read_bytes() == tok_path.read_bytes()

    out = tmp_path / "hf"
    r = spawn(export_and_check, 1, str(checkpoint.parent), str(out), zerotron_cache, timeout=120)[0]
    assert "exit" not in r, r
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    assert r["docs"] == DOCS and r["mismatched"] == [], f"documents {r['mismatched']} encode differently"
    assert r["undecoded"] == [], f"documents {r['undecoded']} decode differently"
    for ids in (config, generation):  # GPT-2's defaults (50256) would lie outside this vocabulary
        assert (ids["eos_token_id"], ids["pad_token_id"], ids["bos_token_id"]) == (r["eod"], r["eod"], BOS_ID)
    assert r["generation_eos"] == r["eod"] and r["pad"] == r["eod"]
    for row in r["new_tokens"]:  # stopped at the forced EOD: 3 tokens of the model's choice, then EOD
        assert len(row) == 4 and row[3] == r["eod"], row
    assert r["records"] == [], "transformers warned:\n" + "\n".join(r["records"])


def test_hf_export_of_a_checkpoint_without_its_tokenizer_names_the_fix(checkpoint, tmp_path, capsys):
    from zerotron.checkpoint.files import CheckpointError
    from zerotron.checkpoint.export import tokenizer_model

    old = tmp_path / "step_00000002"
    shutil.copytree(checkpoint, old)
    meta = json.loads((old / "metadata.json").read_text())
    recorded = meta.pop("tokenizer")
    (old / "metadata.json").write_text(json.dumps(seal(meta)))  # as a checkpoint without the record
    assert convert_checkpoint.main([str(old), "--hf", str(tmp_path / "hf")]) == 2
    assert "--tokenizer PATH" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()  # the error comes before anything is written
    assert tokenizer_model(str(old), recorded["path"]) == Path(recorded["path"])

    meta["tokenizer"] = recorded
    (old / "metadata.json").write_text(json.dumps(seal(meta)))
    wrong = tmp_path / "other.model"
    wrong.write_bytes(b"another tokenizer")
    with pytest.raises(CheckpointError, match="is not the tokenizer .* was trained with"):
        tokenizer_model(str(old), str(wrong))
    (old / recorded["file"]).write_bytes(b"corrupted")
    with pytest.raises(CheckpointError, match="does not match the SHA-256"):
        tokenizer_model(str(old))


def test_convert_refuses_outputs_it_cannot_write_and_names_what_to_export_instead(checkpoint, tmp_path, capsys):
    """Every bad path exits 2 before anything is written, naming the argument and the fix."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    cases = [
        ([str(checkpoint), "--safetensors", str(tmp_path / "adir")], "--safetensors", "is a directory"),
        ([str(checkpoint), "--hf", str(tmp_path / "afile")], "--hf", "is a file"),
        ([str(checkpoint), "--safetensors", str(tmp_path / "afile" / "m.safetensors")],
         f"--safetensors {tmp_path / 'afile' / 'm.safetensors'}: ", f"{tmp_path / 'afile'} is a file, not a directory"),
        ([str(checkpoint), "--safetensors", str(checkpoint / "rank_00000.safetensors")], "--safetensors",
         f"is inside the checkpoint {checkpoint}"),
        ([str(checkpoint), "--hf", str(checkpoint.parent / "step_00000001")], "--hf", "is inside the checkpoint"),
        ([str(checkpoint / "metadata.json"), "--hf", str(tmp_path / "hf")], "checkpoint=",
         f"is a file; give the checkpoint's directory, {checkpoint}"),
        ([str(tmp_path / "adir"), "--hf", str(tmp_path / "hf")], "checkpoint=",
         "no complete checkpoint found; point checkpoint at a step_XXXXXXXX directory"),
    ]
    before = sorted(p.name for p in checkpoint.iterdir())
    for argv, field, needle in cases:
        assert convert_checkpoint.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert field in err and needle in err and "--load" not in err, (argv, err)
    assert sorted(p.name for p in checkpoint.iterdir()) == before and not (tmp_path / "hf").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile"]  # no .partial left anywhere

    broken = tmp_path / "save"
    shutil.copytree(checkpoint.parent, broken)
    newest = sorted(broken.glob("step_*"))[-1]
    shard = next(newest.glob("rank_*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-8])
    assert convert_checkpoint.main([str(broken), "--safetensors", str(tmp_path / "m.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "load an earlier checkpoint" not in err, err
    earlier = sorted(broken.glob("step_*"))[:-1]
    assert (f"export an earlier one, e.g. {earlier[-1]}" if earlier else "there is no earlier checkpoint") in err, err
