"""Each config field is declared once -- type (choices as ``Literal``), default, the docstring
under it -- and the checks are derived from that declaration (``zerotron.config.fields``).

The ``Literal`` fields are found by walking the dataclasses' type hints here, not through
``config.fields``: a field given a ``Literal`` type anywhere in the tree is refused outside it
by ``pretrain_gpt.py`` with exit 2, naming the field, with no list of such fields to update.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import typing
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from zerotron.config import fields
from zerotron.config.run_config import ConfigError, RunConfig

ROOT = Path(__file__).resolve().parents[2]


def walk() -> list[tuple[str, typing.Any]]:
    """``(section.field, declared type)`` of every field of the run config tree."""
    cfg, out = RunConfig(), []
    for section in dataclasses.fields(cfg):
        hints = typing.get_type_hints(type(getattr(cfg, section.name)))
        out += [(f"{section.name}.{name}", tp) for name, tp in hints.items()]
    return out


def literal_fields() -> list[tuple[str, tuple]]:
    """``(section.field, choices)`` of every field whose type is a Literal (or one or None)."""
    out = []
    for key, tp in walk():
        literal = [a for a in (tp, *typing.get_args(tp)) if typing.get_origin(a) is typing.Literal]
        if literal:
            out.append((key, typing.get_args(literal[0])))
    return out


def outside(choices: tuple):
    """A value of the choices' type that is none of them."""
    return max(choices) + 1 if isinstance(choices[0], int) else "not-a-choice"


@pytest.fixture(scope="module")
def pretrain_main():
    spec = importlib.util.spec_from_file_location("pretrain_gpt", ROOT / "scripts" / "pretrain_gpt.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)  # defines functions only: main() runs under __main__
    return script.main


def test_literal_fields_refuse_values_outside_their_choices_with_exit_2(pretrain_main, capsys):
    found = literal_fields()
    assert len(found) >= 15, found  # the walk reached the library sections and the model's
    for key, choices in found:
        bad = outside(choices)
        assert pretrain_main([f"--{key}", str(bad)]) == 2, key
        err = capsys.readouterr().err
        assert f"config error: {key}={bad!r}: use one of {list(choices)}" in err, (key, err)


def test_literal_fields_refuse_values_set_in_code_at_validate():
    for key, choices in literal_fields():
        cfg = RunConfig()
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, outside(choices))
        with pytest.raises(ConfigError, match=rf"^{key}="):
            cfg.validate(1)


def test_a_choice_is_coerced_to_its_type_and_true_is_no_stage():
    from zerotron.config.values import set_field

    cfg = RunConfig()
    set_field(cfg, "zero", "stage", "2")  # a flag's string
    set_field(cfg, "zero", "grad_accum_dtype", "null")
    assert cfg.zero.stage == 2 and cfg.zero.grad_accum_dtype is None
    with pytest.raises(ConfigError, match="zero.stage=True is not a valid int"):
        set_field(cfg, "zero", "stage", True)  # YAML's true is not stage 1
    cfg.zero.stage = True
    with pytest.raises(ConfigError, match=r"zero.stage=True: use one of \[0, 1, 2, 3\]"):
        cfg.validate(1)


def test_every_field_has_one_line_of_help_from_its_declaration():
    keys = [key for key, _ in walk()]
    specs = fields.run_fields(RunConfig)
    assert [s.key for s in specs] == keys and len(keys) > 80
    undocumented = [s.key for s in specs if not s.help]
    assert not undocumented, f"declare a docstring under {undocumented}"
    assert all("\n" not in s.help and "  " not in s.help for s in specs)  # folded to one line


def test_help_is_the_docstring_under_the_field_or_its_metadata():
    @dataclass
    class Section:
        documented: int = 1
        """what it holds,
        over two lines"""
        commented: int = 2  # a comment is for readers of the source, not help
        generated: int = field(default=3, metadata={"help": "from metadata"})

    helps = fields.field_help(Section)
    assert helps == {"documented": "what it holds, over two lines", "generated": "from metadata"}
    specs = fields.section_fields(Section, "s")
    assert specs["commented"].help == "" and specs["documented"].default == 1
