"""``pretrain_gpt.py --help`` documents the whole config tree: every ``--section.field`` with its
type, its default and a line of help, the short flags with the field they set, and the exit codes.

The fields are found by walking the dataclasses here, not through ``config.fields``, so a field
added to any section (``RunConfig`` or the library's ``ParallelDims``, ``ZeroConfig``,
``ActivationCheckpointConfig``, ``GPTConfig``) without help fails this test; each default --help
prints is parsed back through the CLI and must give the field's real default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import typing
from pathlib import Path

import pytest

from zerotron.config.cli import SHORT_FLAGS, set_field
from zerotron.config.run_config import RunConfig

ROOT = Path(__file__).resolve().parents[2]


def walk() -> list[tuple[str, typing.Any, typing.Any]]:
    cfg = RunConfig()
    out = []
    for section in dataclasses.fields(cfg):
        sec = getattr(cfg, section.name)
        assert dataclasses.is_dataclass(sec), section.name
        hints = typing.get_type_hints(type(sec))
        out += [(f"{section.name}.{f.name}", hints[f.name], getattr(sec, f.name)) for f in dataclasses.fields(sec)]
    return out


@pytest.fixture(scope="module")
def help_text() -> str:
    """``scripts/pretrain_gpt.py --help``, run in this process (torch is imported already)."""
    spec = importlib.util.spec_from_file_location("pretrain_gpt", ROOT / "scripts" / "pretrain_gpt.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        script.main(["--help"])
    assert exit_.value.code == 0
    return out.getvalue()


def entries(text: str) -> dict[str, str]:
    """``--section.field`` -> the description line under it, from the epilog."""
    lines = text.splitlines()
    return {ln.strip(): lines[i + 1].strip() for i, ln in enumerate(lines)
            if ln.startswith("  --") and "." in ln and " " not in ln.strip()}


def test_help_names_every_config_field_with_type_default_and_help(help_text):
    documented = entries(help_text)
    fields = walk()
    assert len(fields) > 80  # the walk really went through the nested sections
    missing = [key for key, _, _ in fields if f"--{key}" not in documented]
    assert not missing, f"--help lacks {missing}"
    for key, tp, _ in fields:
        line = documented[f"--{key}"]
        head, _, text = line.partition(": ")
        kind = head.split(",")[0]
        literal = [a for a in (tp, *typing.get_args(tp)) if typing.get_origin(a) is typing.Literal]
        choices = typing.get_args(literal[0]) if literal else ()
        declared = type(choices[0]) if choices else tp  # a Literal is printed as its members' type
        assert kind.rstrip("?") in str(declared) or kind.startswith("list["), (key, line)
        if choices and key != "model.preset":  # the choices are printed from the declaration
            assert f", one of {'|'.join(map(str, choices))}:" in line, (key, line)
        assert kind.endswith("?") == (type(None) in typing.get_args(tp)), (key, line)
        assert ", default " in head and text and text != "(undocumented)", (key, line)
    assert not set(documented) - {f"--{k}" for k, _, _ in fields}, "--help documents a field that does not exist"


def test_every_printed_default_parses_back_to_the_real_default(help_text):
    documented = entries(help_text)
    for key, _, default in walk():
        shown = documented[f"--{key}"].split(", default ", 1)[1].split(": ", 1)[0].split(", one of ")[0]
        if shown.startswith("the preset's") or shown.startswith("null (") or isinstance(default, list):
            continue
        section, name = key.split(".")
        cfg = RunConfig()
        set_field(cfg, section, name, shown)  # what --section.field VALUE does with the value
        got = getattr(getattr(cfg, section), name)
        assert got == default, (key, shown, got, default)


def test_short_flags_name_their_field_and_the_exit_codes_are_listed(help_text):
    options = help_text.split("\noptions:\n", 1)[1].split("\nconfig fields:", 1)[0]
    flags = {}  # "--tp" -> its help, continuation lines joined
    for ln in options.splitlines():
        if ln.startswith("  -"):
            flag, _, rest = ln.strip().partition(" ")
            flags[flag] = rest
        elif flags:
            flags[flag] += " " + ln.strip()
    for flag, (section, name) in SHORT_FLAGS.items():
        assert f"--{section}.{name}" in flags[f"--{flag}"] and ", default " in flags[f"--{flag}"], flag
    flat = " ".join(help_text.split())
    assert "one of fp32|fp16|bf16|fp64" in flat and "one of 0|1|2|3" in flat
    for code in ("0 done", "2 bad input", "3 a collective failed"):
        assert code in flat, code
