"""``scripts/estimate_memory.py`` breaks a setup down only on a world size it was given.

Every per-rank term but the activations divides by DP, so a default world size (it used to be
400 GPUs) turns a 4-process config into a confident wrong answer; a tiny model's terms must read
in units that show them, not as ``0.000 B``.
"""

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import estimate_memory  # noqa: E402

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny.yaml")
ZERO_VALUE = re.compile(r"(?<![\d.])0\.0+ ")  # "0.000 B", "0.00 GB": a value rounded away


def run(capsys, *argv):
    out = estimate_memory.main([*argv, "--c-batches", "4"])
    return out, capsys.readouterr().out


def test_a_config_without_a_world_size_asks_for_gpus(capsys):
    with pytest.raises(SystemExit) as exit_:
        estimate_memory.main(["--config", TINY])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "does not fix the world size" in err and "--gpus N" in err
    with pytest.raises(SystemExit) as exit_:
        estimate_memory.main(["--preset", "zero-100b", "--tp", "16"])
    assert exit_.value.code == 2 and "pass --gpus N" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        estimate_memory.main(["--config", TINY, "--gpus", "3"])  # tp 2 does not divide 3
    assert exit_.value.code == 2 and "does not divide the 3 processes" in capsys.readouterr().err


def test_tiny_config_breakdown_uses_the_given_world_and_readable_units(capsys):
    out, text = run(capsys, "--config", TINY, "--gpus", "4")
    b = out["breakdown"]
    assert (b["gpus"], b["tp"], b["dp"], b["micro_batch"]) == (4, 2, 2, 8)  # tiny.yaml: TP 2, micro-batch 8
    section = text[text.index("Breakdown per GPU"):text.index("largest GPT")]
    assert "tiny on 4 GPUs, MP 2 x DP 2" in section
    assert not ZERO_VALUE.search(section), section
    assert re.search(r"params_total\s+\d+\.\d\d K", section) and re.search(r"fixed_buffers\s+\d+\.\d\d MB", section)
    # TP 2 x DP 2 on NCCL: tp, dp, world communicators of 3 x 24 x 9.19 MiB or 2 x 24 x 9.19 MiB
    assert re.search(r"nccl_communicators\s+1\.62 GB", section) and re.search(r"\stotal\s+1\.6\d GB", section)


def test_a_config_that_fixes_dp_gives_its_own_world(capsys, tmp_path):
    with open(TINY, encoding="utf-8") as f:
        text = f.read()
    config = tmp_path / "tiny-dp4.yaml"
    config.write_text(text.replace("  tp: 2\n", "  tp: 2\n  dp: 4\n"), encoding="utf-8")
    out, _ = run(capsys, "--config", str(config))
    assert (out["breakdown"]["gpus"], out["breakdown"]["dp"]) == (8, 4)
    out, _ = run(capsys, "--config", TINY, "--gpus", "4", "--tp", "1", "--batch", "2")  # flags override the config
    assert (out["breakdown"]["tp"], out["breakdown"]["dp"], out["breakdown"]["micro_batch"]) == (1, 4, 2)


def test_vocab_flag_sizes_the_embedding_of_every_way_of_naming_the_model(capsys):
    """``--vocab V`` overrides a config's, a preset's and a custom GPT's vocabulary: the total
    moves by exactly (V' - V) x hidden (the tied embedding, padded to a multiple of 128 x MP)."""
    for model, hidden, pad in ((["--config", TINY], 64, 256), (["--preset", "zero-1.5b"], 1600, 128),
                               (["--layers", "2", "--hidden", "64", "--heads", "4"], 64, 128)):
        base, _ = run(capsys, *model, "--gpus", "4")
        big, _ = run(capsys, *model, "--gpus", "4", "--vocab", "131072")
        grown = big["breakdown"]["params_total"] - base["breakdown"]["params_total"]
        assert grown % hidden == 0 and grown // hidden > 0 and (131072 - grown // hidden) % pad == 0, (model, grown)


@pytest.mark.parametrize("argv, needle", [
    (["--preset", "nosuch", "--gpus", "8"], "unknown model preset 'nosuch'"),
    (["--preset", "zero-1.5b", "--tp", "-2", "--gpus", "8"], "--tp -2: must be a positive integer"),
    (["--preset", "zero-1.5b", "--gpus", "8", "--batch", "0"], "--batch 0: must be a positive integer"),
    (["--preset", "zero-1.5b", "--gpus", "6", "--tp", "3"], "not divisible by parallel.tp=3"),
    (["--layers", "40", "--hidden", "4096", "--heads", "30", "--gpus", "8"], "not divisible by model.num_heads=30"),
    (["--layers", "4"], "a custom GPT needs --layers, --hidden and --heads"),
    (["--config-name", "C3"], "--config-name shapes a breakdown, which needs a model"),
    (["--gpus", "8", "--pa"], "--gpus --pa shape a breakdown, which needs a model"),
    (["--device-gb", "inf"], "--device-gb inf: must be a finite size > 0"),
    (["--config", TINY, "--preset", "zero-1.5b", "--gpus", "4"], "--config and --preset each name the model"),
    (["--c-batches", "a,b"], "--c-batches 'a,b': give positive micro-batch sizes"),
    (["--c-mp", "0"], "--c-mp 0: must be a positive integer"),
    (["--preset", "zero-1.5b", "--gpus", "8", "--vocab", "0"], "--vocab 0: must be a positive integer"),
    (["--vocab", "512"], "--vocab shapes a breakdown, which needs a model"),
    (["--c-gpus", "100", "--c-mp", "16"], "--c-gpus 100 is not a multiple of --c-mp 16"),
    (["--preset", "zero-100b", "--tp", "16", "--gpus", "400", "--stage", "0", "--config-name", "C4"],
     "--config-name C4 sets the ZeRO stage (2), Pa (True) and Pa+cpu (False); drop --stage or --config-name"),
    (["--preset", "zero-100b", "--tp", "16", "--gpus", "400", "--pa", "--config-name", "C1"], "drop --pa or"),
    (["--stage", "0"], "--stage shapes a breakdown, which needs a model"),
    (["--preset", "zero-1.5b", "--gpus", "8", "--pa"], "--pa partitions activation checkpoints over the MP ranks"),
    (["--config", TINY.replace("tiny.yaml", "zero100b/table10/zero-1.5b.yaml"), "--gpus", "128", "--pa"],
     "this setup has MP 1 (nothing to partition over)"),
])
def test_a_request_it_cannot_answer_as_given_exits_2(capsys, argv, needle):
    """Never a traceback, a breakdown of a layout that cannot exist, or a flag quietly dropped."""
    with pytest.raises(SystemExit) as exit_:
        estimate_memory.main(argv)
    assert exit_.value.code == 2 and needle in capsys.readouterr().err


def test_gpu_flag_sets_the_device_memory_of_the_fit_check(capsys):
    """zero-170b needs ~35 GB a rank: over a V100's 32 (the default), within an H100's 80."""
    config = ["--config", "configs/zero100b/table5/zero-170b.yaml", "--gpus", "400", "--json"]
    v100, h100 = run(capsys, *config)[0], run(capsys, *config, "--gpu", "h100")[0]
    assert 32e9 < v100["breakdown"]["total"] < 80e9
    assert not v100["breakdown"]["fits"] and h100["breakdown"]["fits"]
    pinned = run(capsys, *config, "--gpu", "h100", "--device-gb", "32")[0]
    assert pinned["breakdown"]["fits"] is False
