"""How a value from a YAML file, a flag or a DeepSpeed JSON becomes a config field's value.

One reader of values for every source, so ``--zero.stage 2``, ``stage: 2`` in YAML and DeepSpeed's
``"stage": 2`` are coerced and refused alike, naming the field and what it takes. It sits below
``cli`` and ``deepspeed``, which both set fields through ``set_field``.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import typing
from typing import Any

from zerotron.config.fields import literal_choices, refusal, section_fields
from zerotron.config.run_config import ConfigError, RunConfig


def _coerce(name: str, tp: Any, value: Any) -> Any:
    """Convert ``value`` (from YAML or a string flag) to the field's type, or raise naming the field."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    optional = type(None) in typing.get_args(tp)
    if optional and (value is None or (isinstance(value, str) and value.lower() in ("none", "null"))):
        return None
    base = args[0] if optional and args else tp
    origin = typing.get_origin(base)
    if choices := literal_choices(base):  # read as its members' type; set_field checks membership
        return _coerce(name, type(choices[0]), value)
    try:
        if origin is list:
            (inner,) = typing.get_args(base)
            if not isinstance(value, (str, list, tuple)):  # list({"a": 1}) would quietly become ["a"]
                raise ValueError(value)
            items = value.split(",") if isinstance(value, str) else list(value)
            return [_coerce(f"{name}[{i}]", inner, x) for i, x in enumerate(x for x in items if x != "")]
        if base is bool:
            if isinstance(value, str):
                low = value.lower()
                if low not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                return low in ("true", "1", "yes")
            if not isinstance(value, bool):
                raise ValueError(value)
            return value
        if base is int:
            return _whole(name, value)
        if base is float:
            if isinstance(value, bool):  # YAML's true/yes would otherwise become 1.0
                raise ValueError(value)
            return float(value)
        if base is str:
            return _name(name, value, optional)
    except ConfigError:
        raise
    except (TypeError, ValueError):
        kind = getattr(base, "__name__", base)
        raise ConfigError(f"{name}={value!r} is not a valid {kind}{_TAKES.get(base, '')}") from None
    return value


_TAKES = {  # what to write instead, for the field types a flag or YAML scalar is read as
    bool: "; give true or false",
    int: "; give a whole number, e.g. 2",
    float: "; give a number, e.g. 0.001 or 3e-4",
}


def _name(name: str, value: Any, optional: bool) -> str:
    """A string field's value. YAML turns some unquoted names into other types: a whole number or a
    date reads back as written (2024, 2024-06-01); a float (1.10 -> 1.1), a boolean (off -> False)
    or a mapping would not, so those are refused with the fix."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, datetime.date)) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, (bool, float)):
        none = ", or null for none" if optional else ""
        raise ConfigError(f"{name}={value!r}: YAML read this unquoted name as a {type(value).__name__}; put "
                          f"it in quotes, as you mean it to be read{none}")
    raise ConfigError(f"{name}={value!r} is not a valid str")


def _whole(name: str, value: Any) -> int:
    """An int field's value: an int, or a number written another way that is exactly whole
    ("5e8", 1e3, "2_000"); "2.5e0" or 2.5 is an error rather than silently 2."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(value)
    if isinstance(value, int):
        return value
    try:
        exact = decimal.Decimal(value.strip().replace("_", "") if isinstance(value, str) else value)
    except decimal.InvalidOperation:
        raise ValueError(value) from None
    if not exact.is_finite():
        raise ValueError(value)
    if exact != exact.to_integral_value():
        raise ConfigError(f"{name}={value!r} is not a whole number; {name.split('[')[0]} takes an integer, "
                          f"e.g. {int(exact)}")
    if abs(exact) >= 2**63:
        raise ConfigError(f"{name}={value!r} does not fit a 64-bit integer; give a smaller value")
    return int(exact)


def set_field(cfg: RunConfig, section: str, name: str, value: Any) -> None:
    """Set ``section.name`` from a reader's raw value: coerced to the declared type, and refused
    naming the field when the type cannot hold it or it is outside the field's ``Literal``."""
    if not hasattr(cfg, section) or not dataclasses.is_dataclass(getattr(cfg, section)):
        sections = [f.name for f in dataclasses.fields(cfg)]
        raise ConfigError(f"unknown config section {section!r}; sections are {sections}")
    sec = getattr(cfg, section)
    specs = section_fields(type(sec), section)
    if name not in specs:
        raise ConfigError(f"unknown config key {section}.{name}; keys of {section} are "
                          f"{sorted(specs)}")
    coerced = _coerce(f"{section}.{name}", specs[name].type, value)
    if (why := refusal(specs[name], coerced)) is not None:
        raise ConfigError(why)
    setattr(sec, name, coerced)
