"""``pretrain_gpt.py --help``, generated from the config tree: every ``--section.field`` with its
type, default, choices and one line of help.

Names, types, choices, defaults and the one line of help are each field's own declaration in
its dataclass (``RunConfig``'s sections and the library sections it holds), read through
``zerotron.config.fields``, so --help cannot drift from what the parser accepts;
``tests/config/test_config_help.py`` fails when a field has no help. A ``model`` field's default
is "the preset's": the tiny preset's value is shown with it.
"""

from __future__ import annotations

import textwrap
import typing
from typing import Any

from zerotron.config import fields
from zerotron.model.presets import PRESETS


def run_fields() -> tuple[fields.FieldSpec, ...]:
    """Every field of the run config tree, in its order, as ``zerotron.config.fields`` reads it."""
    from zerotron.config.run_config import RunConfig  # below it: run_config imports fields only

    return fields.run_fields(RunConfig)


def _spec(key: str) -> fields.FieldSpec:
    return next(s for s in run_fields() if s.key == key)


def type_name(tp: Any) -> str:
    """``int``, ``float?`` (null allowed), ``list[str]`` ...; a ``Literal`` by its members' type
    (its choices are listed beside it)."""
    if typing.get_origin(tp) is typing.Literal:
        return type(typing.get_args(tp)[0]).__name__
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if type(None) in typing.get_args(tp):
        return type_name(args[0]) + "?"
    if typing.get_origin(tp) is list:
        return f"list[{type_name(typing.get_args(tp)[0])}]"
    return getattr(tp, "__name__", str(tp))


def _default(key: str, value: Any) -> str:
    if key == "model.vocab_size":
        return "null (the tokenizer's vocabulary)"
    if key.startswith("model.") and key != "model.preset" and value is None:
        tiny = getattr(PRESETS["tiny"], key.split(".", 1)[1], None)
        return f"the preset's (tiny: {_show(tiny)})"
    return _show(value)


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(map(str, value)) or "[]"
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1e4:
        return f"{value:.0f}"
    return str(value)


def describe(spec: fields.FieldSpec) -> str:
    """``TYPE, default D[, one of ...]: help`` for one field (also the help of its short flag)."""
    text = f"{type_name(spec.type)}, default {_default(spec.key, spec.default)}"
    if spec.choices and spec.key != "model.preset":  # the presets are listed at the end instead
        text += f", one of {'|'.join(map(str, spec.choices))}"
    return f"{text}: {spec.help or '(undocumented)'}"


def short_flag_help(section: str, name: str, switch: bool = False) -> str:
    """Help of a short flag: the field it sets, then the field's description; ``switch``: a flag
    that takes no value and sets the boolean field to true."""
    key = f"{section}.{name}"
    return f"{'sets ' if switch else ''}--{key}{' true' if switch else ''} ({describe(_spec(key))})"


def epilog(exit_codes: str = "") -> str:
    """Every config field, section by section, then ``exit_codes``."""
    lines = ["config fields: --section.field VALUE (or --section.field=VALUE) on the command line, or",
             "'section: {field: value}' in the --config YAML; flags win over the YAML, and the defaults",
             "below are the built-in ones a YAML replaces. Lists are comma-separated; null/none clears",
             "an optional (TYPE?) field.", ""]
    section = None
    for spec in run_fields():
        if spec.key.split(".")[0] != section:
            section = spec.key.split(".")[0]
            lines.append(f"{section}:")
        lines.append(f"  --{spec.key}")
        lines.append(f"      {describe(spec)}")
    lines += textwrap.wrap(f"model.preset is one of: {', '.join(PRESETS)}", 100, subsequent_indent="  ", break_on_hyphens=False)
    if exit_codes:
        lines += ["", exit_codes]
    return "\n".join(lines)
