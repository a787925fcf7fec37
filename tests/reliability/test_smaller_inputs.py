"""The smaller bad inputs of issue 46, each refused before any process group (exit 2) naming the
field or the variable: infinite blend weights, a quoted ``~`` path, a save directory inside a
checkpoint, bad ``ZEROTRON_*`` variables; and the disk-space check counts what a shard holds
(12 bytes a parameter in fp32 and bf16; tests/reliability/test_checkpoint_metadata.py compares
it with a real checkpoint's shards).
"""

from __future__ import annotations

import pytest

from zerotron.config.run_config import ConfigError


def _cfg(*flags):
    from zerotron.config.cli import last_wins, parse_config

    base = ["--config", "configs/tiny.yaml", "--tp", "1", "--save", "none"]
    return parse_config(last_wins(base + list(flags)))  # the flags override base


def _preflight(*flags):
    from zerotron.training.setup_run import preflight

    preflight(_cfg(*flags).validate(2))


@pytest.mark.parametrize("flags, needle", [
    (["--data.data_path", "a,b", "--data.data_weights", "1e308,1e308"], "sum to infinity"),
])
def test_validation_refuses(flags, needle):
    with pytest.raises(ConfigError, match=needle):
        _cfg(*flags).validate(2)


def test_a_quoted_tilde_path_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint.save=~/x: '~' is not expanded here"):
        _preflight("--save", "~/x", "--run-dir", str(tmp_path / "run"))


def test_a_save_inside_another_checkpoint_is_refused(tmp_path):
    step = tmp_path / "ck" / "step_00000004"
    step.mkdir(parents=True)
    (step / "metadata.json").write_text("{}")
    with pytest.raises(ConfigError, match=f"is inside the checkpoint {step}"):
        _preflight("--save", str(step / "more"), "--run-dir", str(tmp_path / "run"))


@pytest.mark.parametrize("name, value", [("ZEROTRON_COLLECTIVE_TIMEOUT", "soon"),
                                         ("ZEROTRON_COLLECTIVE_TIMEOUT", "-5"),
                                         ("ZEROTRON_COLLECTIVE_TIMEOUT", "nan"),
                                         ("ZEROTRON_PEAK_TFLOPS", "inf"),
                                         ("ZEROTRON_PEAK_TFLOPS", "nan"),
                                         ("ZEROTRON_DEVICE", "tpu")])
def test_a_bad_environment_variable_is_named(monkeypatch, tmp_path, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        _preflight("--run-dir", str(tmp_path / "run"))


@pytest.mark.parametrize("name, value", [("ZEROTRON_COLLECTIVE_TIMEOUT", "soon"),
                                         ("ZEROTRON_COLLECTIVE_TIMEOUT", "nan"),
                                         ("ZEROTRON_PEAK_TFLOPS", "nan"),
                                         ("ZEROTRON_PEAK_TFLOPS", "fast")])
def test_each_variable_has_one_parser_and_it_names_the_variable(monkeypatch, name, value):
    """The function that uses a variable is the one that reads it (start-up's check calls it), so
    its own error names the variable; it used to be float()'s, or no error for 'nan'."""
    from zerotron.model.flops import peak_tflops
    from zerotron.parallel.runtime import collective_timeout

    monkeypatch.setenv(name, value)
    read = collective_timeout if name == "ZEROTRON_COLLECTIVE_TIMEOUT" else lambda: peak_tflops("")
    with pytest.raises(ValueError, match=f"{name}='{value}' must be a positive number"):
        read()


def test_a_repeated_flag_is_refused_on_every_rank_before_any_process_group(monkeypatch, capsys):
    """``--lr 0.5 --lr 0.001`` trained at 0.001 in silence; now every rank exits 2 naming the flag
    and both values, before ``init_distributed`` (which would raise here)."""
    import zerotron.parallel
    from scripts.pretrain_gpt import main

    def no_group(*args, **kwargs):
        raise AssertionError("a repeated flag reached init_distributed")

    monkeypatch.setattr(zerotron.parallel, "init_distributed", no_group)
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        assert main(["--config", "configs/tiny.yaml", "--lr", "0.5", "--lr", "0.001"]) == 2
        err = capsys.readouterr().err
        assert f"[rank {rank}] config error: --lr is given twice (--lr 0.5, then --lr 0.001)" in err


def test_the_disk_space_check_counts_what_a_shard_holds():
    from zerotron.training.setup_run import checkpoint_bytes, validate_model

    for precision, per in (("fp32", 12), ("bf16", 12), ("fp64", 24)):
        cfg = _cfg("--precision", precision)
        assert checkpoint_bytes(cfg, validate_model(cfg))[2] == per, precision


def test_a_longer_train_steps_is_a_schedule_change_only_where_trained_rates_move():
    """A decay over ``train_steps`` re-stretched by a resume moved the next step's rate in silence
    (issue 46); now it is a schedule change, refused like one. Judged by ``lr_at``: the steps the
    checkpoint trained must keep their rates, which they do before the decay begins."""
    from zerotron.checkpoint import resume
    from zerotron.checkpoint.resume_schedule import restretched
    from zerotron.zero.lr_schedule import lr_at

    cfg = _cfg("--train-steps", "12", "--optimizer.warmup_steps", "2")
    saved = {"training.train_steps": 8}
    (field, old, new), why = restretched({"step": 6, "adam_step": 6}, saved, cfg)
    was, now = lr_at(5, cfg.optimizer, 8), lr_at(5, cfg.optimizer, 12)
    assert (field, old, new) == ("training.train_steps", 8, 12) and was != now
    assert why == f"its update 6 ran at lr {was:.3g}, which a cosine decay over 12 steps puts at " \
                  f"{now:.3g}"
    assert restretched({"step": 2, "adam_step": 2}, saved, cfg) is None  # still warming up
    assert restretched({"step": 6, "adam_step": 6}, saved, _cfg(
        "--train-steps", "12", "--optimizer.decay", "constant")) is None  # no decay to move
    keep = _cfg("--train-steps", "12", "--optimizer.warmup_steps", "2",
                "--optimizer.schedule_steps", "8")
    assert restretched({"step": 6, "adam_step": 6}, saved, keep) is None
    checkpoint = _cfg("--train-steps", "8", "--optimizer.warmup_steps", "2").to_dict()
    assert resume.differences(checkpoint, resume.flatten(keep.to_dict()),
                              only=resume.SCHEDULE) == []  # unset schedule_steps is train_steps
