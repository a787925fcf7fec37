"""Bad input stops the run before ``init_process_group`` with exit 2, naming the field and the fix.

Every case goes through ``scripts/pretrain_gpt.py``'s ``main`` in this process (one rank): what
it checks (``parse_config``, ``RunConfig.validate``, ``setup_run.preflight``) runs before any
process group, so a case that wrongly passes would reach ``init_distributed`` -- patched here to
fail the test instead of starting a run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import zerotron.parallel
from scripts.pretrain_gpt import main
from zerotron.data import IndexedTokenWriter, build_default_corpus
from zerotron.config.cli import last_wins, parse_config
from zerotron.config.run_config import DataSection

BASE = ["--config", "configs/tiny.yaml", "--tp", "1", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--seq-length", "32", "--wandb-mode", "disabled", "--save", "none"]


@pytest.fixture
def run_main(monkeypatch, capsys, tmp_path):
    def no_group(*a, **k):
        raise AssertionError("preflight accepted a bad input: init_distributed was reached")

    monkeypatch.setattr(zerotron.parallel, "init_distributed", no_group)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def run(extra: list[str]) -> tuple[int, str]:
        code = main(last_wins(BASE + ["--run-dir", str(tmp_path / "run"), "--data.cache_dir",
                              str(tmp_path / "c")] + extra))  # extra overrides BASE
        return code, capsys.readouterr().err

    return run


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("extra,needle", [
    (["--lr", "inf"], "optimizer.lr=inf is not a finite number"),
    (["--lr", "nan"], "optimizer.lr=nan is not a finite number"),
    (["--optimizer.min_lr", "-inf"], "optimizer.min_lr=-inf is not a finite number"),
    (["--optimizer.eps", "-1e-8"], "optimizer.eps=-1e-08 must be a finite number > 0"),
    (["--optimizer.eps", "0"], "optimizer.eps=0.0 must be a finite number > 0"),
    (["--optimizer.weight_decay", "-0.1"], "optimizer.weight_decay=-0.1 must be a finite number >= 0"),
    (["--optimizer.clip_grad", "inf"], "optimizer.clip_grad=inf is not a finite number"),
    (["--optimizer.initial_loss_scale", "inf"], "optimizer.initial_loss_scale=inf"),
    (["--model.init_std", "nan"], "model.init_std=nan is not a finite number"),
    (["--model.dropout", "nan"], "model.dropout=nan is not a finite number"),
    (["--lr", "true"], "optimizer.lr='true' is not a valid float"),
    (["--training.seed", "-1"], "training.seed=-1 must be in [0, 2**62)"),
    (["--logging.peak_tflops", "0"], "logging.peak_tflops=0.0 must be a finite number > 0"),
    (["--data.default_corpus_vocab", "0"], "data.default_corpus_vocab=0 must be a finite number > 0"),
    (["--data.data_path", "a,b", "--data.tokenizer", "t.model", "--data.data_weights", "-1,2"],
     "data.data_weights[0]=-1.0 must be a finite number >= 0"),
    (["--data.data_path", "a,b", "--data.tokenizer", "t.model", "--data.data_weights", "0,0"],
     "data.data_weights=[0.0, 0.0] sum to 0"),
    (["--data.data_path", "a", "--data.tokenizer", "t.model", "--data.data_weights", "inf"],
     "data.data_weights=[inf] is not a finite number"),
    (["--train-steps", "2.5e0"], "training.train_steps='2.5e0' is not a whole number; training.train_steps takes "
                                 "an integer, e.g. 2"),
    (["--micro-batch-size", "1.5"], "training.micro_batch_size='1.5' is not a whole number"),
    (["--train-steps", "1e999"], "training.train_steps='1e999' does not fit a 64-bit integer"),
    (["--train-steps", "inf"], "training.train_steps='inf' is not a valid int"),
    (["--model.max_position_embeddings", "16"], "raise model.max_position_embeddings to >= 32 or shorten "
                                                "model.seq_length"),
    (["--model.ffn_hidden_size", "0"], "model.ffn_hidden_size=0: must be a positive integer, or null"),
    (["--model.vocab_size", "0"], "model.vocab_size=0 must be a positive integer, or null"),
    (["--run-dir", ""], "logging.run_dir is empty"),
    (["--data.eval_path", "held_out"], "data.eval_path=['held_out'] is set but data.data_path is not"),
    (["--data.tokenizer", "t.model"], "data.tokenizer=t.model: not found"),  # the corpus's tokenizer
])
def test_bad_value_exits_2_naming_the_field(run_main, extra, needle):
    code, err = run_main(extra)
    assert code == 2, err
    assert "config error" in err and needle in err, err


def test_integral_exponent_ints_are_accepted():
    cfg = parse_config(["--train-steps", "5e8", "--zero.reduce_bucket_size", "5e8", "--training.seed", "1.2e3"])
    assert (cfg.training.train_steps, cfg.zero.reduce_bucket_size, cfg.training.seed) == (500_000_000,) * 2 + (1200,)


@pytest.mark.parametrize("extra,needle", [
    (["--zero-stage", "two"], "zero.stage='two' is not a valid int; give a whole number"),
    (["--checkpoint.fallback", "maybe"], "checkpoint.fallback='maybe' is not a valid bool; give true or false"),
    (["--lr", "fast"], "optimizer.lr='fast' is not a valid float; give a number"),
    (["--data.data_weights", "x"], "data.data_weights[0]='x' is not a valid float; give a number"),
])
def test_a_value_of_the_wrong_type_says_what_the_field_takes(run_main, extra, needle):
    code, err = run_main(extra)
    assert code == 2 and needle in err, err


def test_a_run_dir_that_cannot_be_made_is_named_before_the_save_dir_inside_it(run_main, tmp_path):
    """``--run-dir`` is what the user gave; ``checkpoint.save: "{run_dir}/checkpoints"`` only follows it."""
    (tmp_path / "a_file").write_text("")
    run_dir = tmp_path / "a_file" / "run"
    code, err = run_main(["--run-dir", str(run_dir), "--save", "{run_dir}/checkpoints"])
    assert code == 2 and f"config error: logging.run_dir={run_dir}: " in err, err


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"])
def test_empty_yaml_is_refused(run_main, tmp_path, text):
    code, err = run_main(["--config", _yaml(tmp_path, text)])
    assert code == 2 and "the file is empty" in err and "configs/tiny.yaml" in err, err


def test_yaml_int_field_with_fraction_is_refused(run_main, tmp_path):
    code, err = run_main(["--config", _yaml(tmp_path, "training:\n  train_steps: 2.5\n")])
    assert code == 2 and "training.train_steps=2.5 is not a whole number" in err, err


@pytest.mark.parametrize("text, needle", [
    ("logging:\n  run_dir: [a, b]\n", "logging.run_dir=['a', 'b'] is not a valid str"),
    ("checkpoint:\n  save: {x: 1}\n", "checkpoint.save={'x': 1} is not a valid str"),
    ("data:\n  data_path: {a: 1}\n", "data.data_path={'a': 1} is not a valid list"),
    ("checkpoint:\n  load: false\n", "checkpoint.load=False: YAML read this unquoted name as a bool; put it in "
                                      "quotes, as you mean it to be read, or null for none"),
    ("logging:\n  wandb_project: 1.10\n", "YAML read this unquoted name as a float"),
    ("a: 1\n? [b, c]\n: 2\n", "a list is not a key"),
])
def test_yaml_value_of_the_wrong_shape_is_refused(run_main, tmp_path, text, needle):
    code, err = run_main(["--config", _yaml(tmp_path, text)])
    assert code == 2 and needle in err, err


def test_yaml_names_that_read_back_as_written_and_merge_keys_are_kept(tmp_path):
    """A whole number or a date is a name as written; ``<<: *anchor`` merges, and a key after it
    overrides the merged one (that is not a duplicate)."""
    import yaml

    from zerotron.config.cli import _NoDuplicates

    merged = yaml.load("base: &b {lr: 0.1, min_lr: 0.01}\nopt:\n  <<: *b\n  lr: 0.2\n", Loader=_NoDuplicates)
    assert merged["opt"] == {"lr": 0.2, "min_lr": 0.01}
    cfg = parse_config(["--config", _yaml(tmp_path, "logging:\n  run_dir: 2024-06-01\n  wandb_project: 2024\n")])
    assert (cfg.logging.run_dir, cfg.logging.wandb_project) == ("2024-06-01", "2024")


def test_yaml_key_given_twice_is_refused(run_main, tmp_path):
    code, err = run_main(["--config", _yaml(tmp_path, "training:\n  train_steps: 5\n  train_steps: 6\n")])
    assert code == 2 and "key 'train_steps' is given twice" in err, err


def test_an_abbreviated_flag_is_not_taken_for_another(run_main):
    code, err = run_main(["--train", "5"])  # not --train-steps
    assert code == 2 and "unknown argument '--train'" in err, err


@pytest.mark.parametrize("flag, field", [("--run-dir", "logging.run_dir"), ("--data.cache_dir", "data.cache_dir")])
def test_a_directory_that_cannot_be_made_is_refused_before_start_up(run_main, tmp_path, flag, field):
    (tmp_path / "afile").write_text("x")
    code, err = run_main([flag, str(tmp_path / "afile" / "sub")])
    assert code == 2 and f"{field}=" in err and "is a file, not a directory" in err, err


def _short_corpus(tmp_path: Path, cache: str, tokens: int) -> list[str]:
    _, tokenizer, _ = build_default_corpus(cache, vocab_size=DataSection.default_corpus_vocab)
    prefix = str(tmp_path / "short")
    with IndexedTokenWriter(prefix, DataSection.default_corpus_vocab) as w:
        w.add_document(list(range(1, tokens + 1)))
    return ["--data.data_path", prefix, "--data.tokenizer", tokenizer]


def test_corpus_shorter_than_one_sample_is_refused(run_main, tmp_path, zerotron_cache):
    code, err = run_main(_short_corpus(tmp_path, zerotron_cache, 32))  # seq_length 32 needs 33 tokens
    assert code == 2, err
    assert "data.data_path=" in err and "holds 32 tokens, fewer than model.seq_length + 1 = 33" in err, err


def test_eval_corpus_shorter_than_one_sample_is_refused(run_main, tmp_path, zerotron_cache):
    train, _, evals = build_default_corpus(zerotron_cache, vocab_size=DataSection.default_corpus_vocab)
    args = _short_corpus(tmp_path, zerotron_cache, 5)
    args[1] = train  # a real training corpus, a 5-token eval file
    code, err = run_main(args + ["--data.eval_path", str(tmp_path / "short")])
    assert code == 2 and "data.eval_path=" in err and "holds 5 tokens" in err, err


def test_exactly_one_sample_is_enough(run_main, tmp_path, zerotron_cache):
    with pytest.raises(AssertionError, match="init_distributed was reached"):
        run_main(_short_corpus(tmp_path, zerotron_cache, 33))


def test_token_files_of_another_tokenizer_are_refused(run_main, tmp_path, zerotron_cache):
    args = _short_corpus(tmp_path, zerotron_cache, 40)
    with IndexedTokenWriter(args[1], DataSection.default_corpus_vocab - 24) as w:  # written for a 1000-token one
        w.add_document(list(range(1, 41)))
    code, err = run_main(args)
    assert code == 2 and "data.data_path=" in err, err
    assert f"tokenized with a {DataSection.default_corpus_vocab - 24}-token vocabulary" in err, err
    assert f"has {DataSection.default_corpus_vocab} tokens" in err and "preprocess_data.py" in err, err


def test_save_dir_under_a_file_is_refused(run_main, tmp_path):
    (tmp_path / "afile").write_text("x")
    code, err = run_main(["--save", str(tmp_path / "afile" / "ck")])
    assert code == 2 and "checkpoint.save=" in err and "is a file, not a directory" in err, err


def test_save_dir_without_room_for_one_checkpoint_is_refused(run_main, tmp_path, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 20))  # 1 MiB free
    code, err = run_main(["--save", str(tmp_path / "ck" / "deeper")])
    assert code == 2, err
    assert "checkpoint.save=" in err and "one checkpoint needs about" in err and "12 bytes" in err, err
    assert "has 1.0 MiB free" in err and "unset checkpoint.save" in err, err
    assert not (tmp_path / "ck").exists()  # judged by its parent, nothing created


def test_checkpoint_size_estimate_counts_every_rank():
    from zerotron.training.setup_run import checkpoint_bytes, validate_model

    cfg = parse_config(BASE + ["--precision", "bf16"]).validate(1)
    mcfg = validate_model(cfg)
    need, n, per = checkpoint_bytes(cfg, mcfg)
    assert per == 12 and n == mcfg.exact_num_params(1) and need == 12 * n  # what a shard holds
    cfg = parse_config(BASE + ["--pp", "2"]).validate(2)
    _, n_pp, per = checkpoint_bytes(cfg, validate_model(cfg))
    assert per == 12 and n_pp == n + mcfg.padded_vocab_size(1) * mcfg.hidden_size  # tied embedding twice


def test_token_files_of_another_hf_tokenizer_of_the_same_size_exit_2_naming_both(run_main, tmp_path):
    from tests.hf_tokenizers import LINES, bpe_tokenizer_dir, swap_two_tokens
    from zerotron.data import Tokenizer
    from zerotron.data.preprocess import tokenize_to_file

    made_with = bpe_tokenizer_dir(tmp_path / "hf")
    other = swap_two_tokens(made_with, tmp_path / "other")
    prefix = str(tmp_path / "tokens")
    tokenize_to_file([" ".join(LINES)], Tokenizer.load(str(made_with)), prefix, progress=False)
    code, err = run_main(["--data.data_path", prefix, "--data.tokenizer", str(other)])
    assert code == 2 and "data.data_path=" in err, err
    assert f"tokenized with {made_with}" in err and f"otherwise than {other}" in err, err
