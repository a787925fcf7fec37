"""Token files carry their tokenizer's fingerprint and a run with another tokenizer is refused;
a killed tokenizer worker stops preprocessing instead of hanging it (issue 46).

Reference: ``encoding_digest``, the comparison checkpoints already make, and a second tokenizer
of the same vocabulary size trained on other text (its ids mean other pieces).
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.data.conftest import CORPUS
from zerotron.data import fingerprint, preprocess, train_tokenizer
from zerotron.data.indexed import IndexedTokenDataset
from zerotron.data.preprocess import WorkerDied, tokenize_to_file
from zerotron.config.run_config import ConfigError


def _check(prefix: str, tokenizer: str) -> None:
    from zerotron.config.cli import parse_config
    from zerotron.training.setup_run import check_data

    cfg = parse_config(["--config", "configs/tiny.yaml", "--tp", "1", "--seq-length", "8",
                        "--save", "none", "--data.data_path", prefix, "--data.tokenizer", tokenizer])
    check_data(cfg, tokenizer, [prefix], [])


def test_token_files_made_with_another_tokenizer_are_refused_naming_both(tokenizer, tmp_path):
    texts = [t[::-1] for t in CORPUS] + ["zebra quartz " * 9] * 20
    other = train_tokenizer(texts, str(tmp_path / "other"), vocab_size=tokenizer.vocab_size)
    assert other.vocab_size == tokenizer.vocab_size  # same size: the .idx cannot tell them apart
    prefix = str(tmp_path / "corpus")
    tokenize_to_file(CORPUS, tokenizer, prefix, progress=False)
    assert os.path.isfile(prefix + fingerprint.SUFFIX)
    assert IndexedTokenDataset(prefix).vocab_size == 400
    _check(prefix, tokenizer.model_path)  # its own tokenizer: accepted
    with pytest.raises(ConfigError) as err:
        _check(prefix, other.model_path)
    text = str(err.value)
    made_with = os.path.abspath(tokenizer.model_path)
    assert f"data.data_path={prefix}: was tokenized with {made_with}" in text
    assert f"encodes otherwise than {other.model_path}" in text
    os.remove(prefix + fingerprint.SUFFIX)  # no record (older files, Megatron's): not checked
    _check(prefix, other.model_path)


def _dies(texts, append_eod):  # a worker killed mid-file, as the OOM killer would
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_worker_stops_preprocessing_instead_of_hanging(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(preprocess, "_encode", _dies)  # inherited by the forked workers
    prefix = str(tmp_path / "corpus")
    with pytest.raises(WorkerDied, match="a tokenizer worker process died"):  # a hang: the
        tokenize_to_file(iter(CORPUS * 4), tokenizer, prefix, workers=2,  # suite's timeout fails it
                         batch_size=8, progress=False)
    assert not any(os.path.exists(prefix + s) for s in (".bin", ".idx", fingerprint.SUFFIX))


def test_the_run_tokenizer_is_digested_once_for_all_its_token_files(tokenizer, tmp_path,
                                                                     monkeypatch):
    """Each token file's record is compared with one digest of the run's tokenizer: it used to be
    recomputed per prefix (a SentencePiece parse and hash for every file of a blend)."""
    from zerotron.data import tokenizer as tokenizer_module
    from zerotron.config.cli import parse_config
    from zerotron.training.setup_run import check_data

    prefixes = [str(tmp_path / f"part{i}") for i in range(3)]
    for prefix in prefixes:
        tokenize_to_file(CORPUS, tokenizer, prefix, progress=False)
    calls = []
    real = tokenizer_module.encoding_digest
    monkeypatch.setattr(tokenizer_module, "encoding_digest", lambda p: calls.append(p) or real(p))
    cfg = parse_config(["--config", "configs/tiny.yaml", "--tp", "1", "--seq-length", "8",
                        "--save", "none", "--data.tokenizer", tokenizer.model_path])
    check_data(cfg, tokenizer.model_path, prefixes[:2], prefixes[2:])
    assert calls == [tokenizer.model_path]
