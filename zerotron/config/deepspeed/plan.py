"""A DeepSpeed JSON as a list of assignments to the run config, applied after the command line.

Reading a section (``mapping.py``, ``optim.py``) yields ``Assign`` s -- DeepSpeed key, zerotron
field, value -- instead of writing the config, for two reasons: the command line must win over
the JSON (precedence YAML < DeepSpeed JSON < flags), and several values depend on the final run
config (``"auto"``, a ratio of the final learning rate, the batch triple's data-parallel size).
So the JSON is applied *after* the flags, skipping every field a flag set, and each value that
depends on the run config is a function of it, evaluated in order when applied.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from zerotron.config.deepspeed.schema import DeepSpeedKeyError


@dataclass
class Assign:
    path: str                         # the DeepSpeed key, for messages
    target: str                       # "section.field" of the run config
    value: Any                        # a value, or ``fn(cfg)`` computing it when applied
    auto: str = ""                    # an "auto" resolution: where the value comes from ({} = the value)
    show: Callable | None = None      # ``fn(cfg)``: the resolved DeepSpeed value, when not the field's


@dataclass
class Plan:
    assigns: list[Assign] = field(default_factory=list)
    notes: list = field(default_factory=list)  # str, fn(cfg) -> str | None, or (fn, field a flag makes moot)

    def set(self, path: str, target: str, value: Any, auto: str = "", show: Callable | None = None) -> None:
        self.assigns.append(Assign(path, target, value, auto, show))

    def note(self, text, unless_flagged: str = "") -> None:
        """A start-up line: a string, or ``fn(cfg)`` giving one (or None) once the plan is applied.
        ``unless_flagged``: the field the line is about, when a command-line value for it makes the
        line moot (a flag, not the run config, then decided it)."""
        self.notes.append((text, unless_flagged) if unless_flagged else text)


def get(cfg, target: str) -> Any:
    section, name = target.split(".", 1)
    return getattr(getattr(cfg, section), name)


def apply(plan: Plan, cfg, set_field: Callable, flagged: set[str], origins: dict | None = None) -> list[str]:
    """Write the plan into ``cfg`` (``set_field(cfg, section, name, value)`` coerces and checks the
    type), except the fields in ``flagged`` (set on the command line); return the start-up lines.
    ``origins`` (when given) receives ``field -> DeepSpeed key`` for each field written."""
    lines = [n for n in plan.notes if isinstance(n, str)]
    for a in plan.assigns:
        if a.target in flagged:
            if not a.auto:
                value = a.value(cfg) if callable(a.value) else a.value
                lines.append(f"{a.path}={_show(value)} is overridden by the command line: {a.target}="
                             f"{_show(get(cfg, a.target))}")
            else:
                lines.append(_auto_line(a, cfg) + " from the command line")
            continue
        value = a.value(cfg) if callable(a.value) else a.value
        try:
            set_field(cfg, *a.target.split(".", 1), value)
        except ValueError as e:
            raise DeepSpeedKeyError(f"{a.path}={_show(value)}: {e}") from None
        if origins is not None and not a.auto:  # an "auto" value is the run config's own, not the JSON's
            origins[a.target] = a.path
        if a.auto:
            lines.append(_auto_line(a, cfg))
    later = [n for n in plan.notes if callable(n) or (isinstance(n, tuple) and n[1] not in flagged)]
    return lines + [line for n in later if (line := (n if callable(n) else n[0])(cfg))]


def _auto_line(a: Assign, cfg) -> str:
    """``optimizer.params.lr: auto -> 0.003 (optimizer.lr)``."""
    field_value = _show(get(cfg, a.target))
    shown = a.show(cfg) if a.show is not None else field_value
    source = a.auto.format(field_value) if "{}" in a.auto else a.auto
    return f"{a.path}: auto -> {shown} ({source})"


def _show(value: Any) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1e4:
        return str(int(value))
    return repr(value) if isinstance(value, str) else str(value)


def whole(path: str, value: Any, at_least: int = 0) -> int:
    """An integer key (DeepSpeed JSON writes 5e8 for 500000000), or an error naming it."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < at_least:
        raise DeepSpeedKeyError(f"{path}={value!r}: must be an integer >= {at_least}")
    return value


def number(path: str, value: Any, at_least: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= at_least:
        raise DeepSpeedKeyError(f"{path}={value!r}: must be a number >= {at_least:g}")
    return float(value)


def flag(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise DeepSpeedKeyError(f"{path}={value!r}: must be true or false")
    return value
