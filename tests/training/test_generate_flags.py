"""``scripts/generate.py`` refuses bad input with exit 2 naming the flag, before it reads a model
or starts a process group (the checks run on every rank alike)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import generate as generate_script  # noqa: E402


@pytest.mark.parametrize("extra, needle", [
    (["--tp", "2"], "--tp 2 on 1 rank(s)"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0: give at least 1"),
    (["--temperature", "-1"], "--temperature -1.0"),
    (["--top-p", "0.5"], "--top-p 0.5 with greedy decoding does nothing"),
    (["--temperature", "1", "--top-p", "1.5"], "--top-p 1.5: give a probability in (0, 1]"),
])
def test_a_bad_flag_exits_2_naming_it(extra, needle, monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as stop:
        generate_script.main(["--load", str(tmp_path), "--prompt-ids", "1,2", *extra])
    assert stop.value.code == 2
    assert needle in capsys.readouterr().err


def test_bad_ids_and_a_missing_model_exit_2(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit):
        generate_script.main(["--load", str(tmp_path), "--prompt-ids", "1,x"])
    assert "give integers separated by commas" in capsys.readouterr().err
    assert generate_script.main(["--load", str(tmp_path / "none"), "--prompt-ids", "1"]) == 2
    assert "--load=" in capsys.readouterr().err
    assert generate_script.main(["--hf", str(tmp_path), "--prompt-ids", "1"]) == 2
    assert f"--hf {tmp_path}: no config.json there" in capsys.readouterr().err
