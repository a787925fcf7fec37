"""Every config field as its declaration gives it: dotted key, type, choices, default, help.

A field is declared once, in its section's dataclass: the type (a ``Literal`` when the field
takes one of a fixed set of values), the default, and the docstring under it, its one line of
help -- the scheme of torchtitan's ``JobConfig``, whose per-field docstrings a CLI library reads;
here ``ast`` reads them from the class's source, once per class. A generated dataclass (the
``model`` section) has no source, so it carries each help in its field's ``metadata["help"]``.

Everything that used to keep its own table reads this instead: ``--help`` (``help``), the
manual's configuration page (``page``), the coercion and choice check of a YAML, flag or DeepSpeed
value (``values.set_field``) and ``RunConfig.validate``'s choice check (``refusal``).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class FieldSpec:
    """One field of the run config tree as declared: what --help, the page and the checks read."""

    key: str  # "section.field"
    type: Any  # the declared type, "| None" included
    default: Any  # a fresh tree's value (a factory's product for lists)
    help: str  # the docstring under the declaration, whitespace folded; "" when there is none

    @property
    def optional(self) -> bool:
        """null is a value the field takes (its type is ``X | None``)."""
        return type(None) in typing.get_args(self.type)

    @property
    def choices(self) -> tuple:
        """The values of a ``Literal`` type (``Literal[...] | None`` too); () for any other."""
        return literal_choices(self.type)


def literal_choices(tp: Any) -> tuple:
    """``Literal[0, 1] | None`` -> ``(0, 1)``; a type that is no Literal -> ``()``."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    members = [a for a in typing.get_args(tp) if a is not type(None)]
    if len(members) == 1 and typing.get_origin(members[0]) is Literal:
        return typing.get_args(members[0])
    return ()


@functools.cache
def field_help(cls: type) -> dict[str, str]:
    """``field -> help`` of one dataclass: ``metadata["help"]``, else the string literal that
    follows the field's annotated assignment in the class body (an attribute docstring)."""
    helps = {f.name: " ".join(f.metadata["help"].split())
             for f in dataclasses.fields(cls) if "help" in f.metadata}
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # a generated class: its fields carry metadata instead
        return helps
    body = ast.parse(source).body[0].body
    for stmt, after in zip(body, body[1:]):
        doc = after.value if isinstance(after, ast.Expr) else None
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(doc, ast.Constant) and isinstance(doc.value, str)):
            helps.setdefault(stmt.target.id, " ".join(doc.value.split()))
    return helps


@functools.cache
def section_fields(section_cls: type, section: str) -> dict[str, FieldSpec]:
    """``name -> FieldSpec`` of one section, in declaration order."""
    hints, helps, fresh = typing.get_type_hints(section_cls), field_help(section_cls), section_cls()
    return {f.name: FieldSpec(f"{section}.{f.name}", hints[f.name], getattr(fresh, f.name),
                              helps.get(f.name, ""))
            for f in dataclasses.fields(section_cls)}


@functools.cache
def run_fields(root_cls: type) -> tuple[FieldSpec, ...]:
    """Every field of the tree rooted at ``root_cls`` (``RunConfig``), section by section."""
    root = root_cls()
    sections = [(type(getattr(root, f.name)), f.name) for f in dataclasses.fields(root_cls)]
    return tuple(spec for cls, name in sections for spec in section_fields(cls, name).values())


def refusal(spec: FieldSpec, value: Any) -> str | None:
    """Why ``value`` is not one of the field's choices (naming the field, the value, the choices
    and what the field is), or None when it is one, or the field has none."""
    if not spec.choices or (value is None and spec.optional):
        return None
    if any(value == c and type(value) is type(c) for c in spec.choices):  # True is not stage 1
        return None
    null = ", or null" if spec.optional else ""
    return f"{spec.key}={value!r}: use one of {list(spec.choices)}{null} ({spec.help})"


def first_refusal(cfg: Any) -> str | None:
    """The first field of a config tree holding a value outside its choices, as ``refusal``
    words it: for values set in code, which no reader has coerced."""
    for spec in run_fields(type(cfg)):
        section, name = spec.key.split(".")
        why = refusal(spec, getattr(getattr(cfg, section), name))
        if why:
            return why
    return None
