"""A Hugging Face tokenizer directory wherever a SentencePiece ``.model`` is accepted (issue 43).

Reference: transformers' own ``AutoTokenizer`` over the same directory (a tiny ``tokenizers``
BPE trained here, saved with ``save_pretrained``): our ids must be its ids, documents delimited
by its bos and eos ids. A second tokenizer of the same vocabulary size (two ids swapped) must be
refused, naming both.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.data.test_token_fingerprint import _check
from tests.hf_tokenizers import LINES, bpe_tokenizer_dir, swap_two_tokens
from zerotron.data import IndexedTokenDataset, Tokenizer, build_default_corpus, fingerprint
from zerotron.data.tokenizer import encoding_digest
from zerotron.config.run_config import ConfigError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import preprocess_data  # noqa: E402

TEXTS = ["the quick brown fox", "def forward(self, x): return x + 1  # zero ▁ naïve"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return bpe_tokenizer_dir(tmp_path_factory.mktemp("hf") / "tok")


def test_ids_are_transformers_ids_and_documents_are_bos_text_eos(hf_dir, tmp_path):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(hf_dir))
    tok = Tokenizer.load(str(hf_dir))
    ours = (tok.bos_id, tok.eod_id, tok.vocab_size)
    assert ours == (ref.bos_token_id, ref.eos_token_id, len(ref))
    for text in TEXTS:
        assert [tok.bos_id] + tok.encode(text) == ref.encode(text)  # its post-processor adds bos
    rows = tmp_path / "docs.jsonl"
    rows.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    prefix = str(tmp_path / "tokens")
    assert preprocess_data.main([str(rows), "--tokenizer", str(hf_dir), "--output-prefix", prefix,
                                 "--workers", "2", "--no-progress"]) == 0
    ds = IndexedTokenDataset(prefix)
    for i, text in enumerate(TEXTS):
        doc = ds.get(i).tolist()
        assert doc == ref.encode(text) + [ref.eos_token_id]
        assert ref.decode(doc[1:-1]) == text
    assert os.path.isfile(prefix + fingerprint.SUFFIX)


def test_a_token_file_of_another_tokenizer_of_the_same_size_is_refused(hf_dir, tmp_path):
    other = swap_two_tokens(hf_dir, tmp_path / "other")
    assert Tokenizer.load(str(other)).vocab_size == Tokenizer.load(str(hf_dir)).vocab_size
    prefix = str(tmp_path / "tokens")
    rows = tmp_path / "docs.txt"
    rows.write_text(" ".join(LINES))
    assert preprocess_data.main([str(rows), "--tokenizer", str(hf_dir), "--output-prefix", prefix,
                                 "--workers", "1", "--no-progress"]) == 0
    _check(prefix, str(hf_dir))  # its own: accepted
    with pytest.raises(ConfigError) as err:
        _check(prefix, str(other))
    assert f"was tokenized with {hf_dir}" in str(err.value)
    assert f"encodes otherwise than {other}" in str(err.value)
    resaved = bpe_tokenizer_dir(tmp_path / "again")  # the same tokenizer saved again: accepted
    _check(prefix, str(resaved))


def test_the_built_in_corpus_encoded_with_an_hf_tokenizer(hf_dir, tmp_path, monkeypatch):
    from zerotron.data import default_corpus

    docs = [f"{i}: {line}" for i, line in enumerate(LINES * 5)]  # the harvest is not under test
    monkeypatch.setattr(default_corpus, "harvest_stdlib_texts", lambda: docs)
    no_bos = bpe_tokenizer_dir(tmp_path / "qwen-like", bos=False)
    for tokenizer in (hf_dir, no_bos):
        tok = Tokenizer.load(str(tokenizer))
        cache = str(tmp_path / "cache")
        train, tok_path, evals = build_default_corpus(cache, tokenizer=str(tokenizer))
        assert tok_path == str(tokenizer)
        ds = IndexedTokenDataset(evals)
        assert ds.vocab_size == tok.vocab_size
        doc = ds.get(0).tolist()
        assert doc[-1] == tok.eod_id
        assert (doc[0] == tok.bos_id) == (tokenizer == hf_dir)
        digest = encoding_digest(str(tokenizer))  # once per run, as setup_run computes it
        assert fingerprint.mismatch(train, str(tokenizer), digest) is None
        assert fingerprint.mismatch(evals, str(tokenizer), digest) is None
    other = encoding_digest(str(hf_dir))  # the other one's files name the other one
    assert fingerprint.mismatch(train, str(hf_dir), other)


def test_init_from_hf_makes_the_directory_the_run_s_tokenizer(hf_dir, tmp_path):
    import shutil

    from transformers import LlamaConfig

    from zerotron.config.cli import parse_config

    model_dir = tmp_path / "llama"
    LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                architectures=["LlamaForCausalLM"]).save_pretrained(model_dir)
    base = ["--config", "configs/tiny.yaml", "--tp", "1", "--init-from-hf", str(model_dir)]
    assert parse_config(base).data.tokenizer is None  # no tokenizer.json there: left as it was
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_dir / name, model_dir / name)
    assert parse_config(base).data.tokenizer == str(model_dir)
    named = parse_config(base + ["--data.tokenizer", str(hf_dir)])  # the user's choice stands
    assert named.data.tokenizer == str(hf_dir)
