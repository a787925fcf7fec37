"""What a DeepSpeed key *is* to zerotron: honoured, mapped, accepted with no effect, or refused.

One ``Key`` per DeepSpeed key (the table itself is ``keys.py``), so the reader, the start-up notes
and the manual's key table (``markdown_table``, in docs/deepspeed.md) cannot disagree. ``check``
walks a config against it: a key or section that is not DeepSpeed's is an error with the closest
valid key (a misspelled ``zero_optimisation`` must not run stage 0 in silence), a value zerotron cannot run the way
DeepSpeed would is an error saying why, and every key with no effect here is returned so it can be
printed once at start-up -- nothing is dropped silently.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

HONOURED, MAPPED, NO_EFFECT, REFUSED = "honoured", "mapped", "no effect", "refused"


class DeepSpeedKeyError(ValueError):
    """A DeepSpeed JSON key or value zerotron refuses; the message names the key and the fix."""


@dataclass(frozen=True)
class Key:
    """``note``: honoured/mapped -- the zerotron field it sets; no effect/refused -- why.
    ``refuse(value)``: the reason a value cannot run here (None: it can), with ``refused_when`` its
    words for the table. ``keys``: a section's own keys, checked; ``loose``: a section whose
    content is not checked, because the whole section has one status (no effect / refused)."""

    status: str
    note: str
    refuse: Callable[[Any], str | None] | None = None
    refused_when: str = ""
    keys: Mapping[str, "Key"] | None = None
    loose: bool = False
    auto: bool = False  # "auto" is resolved from the run config (resolve.py)
    lax: type | None = None  # bool / int / float: DeepSpeed reads it through pydantic, which coerces "2", "true"
    nullable: bool = False  # DeepSpeed's field is Optional: null is the key left out


def closest(name: str, known) -> str:
    """`` (did you mean X?)`` for the nearest known key, else the list of valid keys."""
    match = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    if match:
        return f" (did you mean {match[0]}?)"
    return f"; valid keys here are {sorted(known)}"


def check(data: dict, table: Mapping[str, Key]) -> list[str]:
    """Check ``data`` (a whole DeepSpeed config) against ``table``; return the start-up lines of the
    keys it holds that have no effect here. Raises ``DeepSpeedKeyError`` for an unknown key, a
    section that is not an object, or a value ``refuse`` refuses. ``data`` is normalized in place
    as DeepSpeed reads it: a ``nullable`` key set to null is removed, a ``lax`` one coerced."""
    notes: list[str] = []
    _walk(data, table, "", notes)
    return notes


def _walk(section: dict, table: Mapping[str, Key], prefix: str, notes: list[str]) -> None:
    for name, value in list(section.items()):
        path = f"{prefix}{name}"
        key = table.get(name)
        if key is None:
            where = f"in {prefix[:-1]}" if prefix else "at the top level"
            raise DeepSpeedKeyError(f"{path}: not a DeepSpeed key {where}{closest(name, table)}")
        if value is None and key.nullable:
            del section[name]
            continue
        if key.lax is not None and value is not None and value != "auto":
            value = section[name] = coerce(path, value, key.lax)
        if key.keys is not None or key.loose:
            if value is None and key.loose:
                continue
            if not isinstance(value, dict):
                raise DeepSpeedKeyError(f"{path} must be a JSON object of DeepSpeed keys (like "
                                        f"{_example(key)}), got {type(value).__name__} {value!r}")
        if isinstance(value, str) and value == "auto" and not key.auto:
            raise DeepSpeedKeyError(f"{path}: \"auto\" is not resolvable for this key (zerotron resolves it "
                                    f"where the Hugging Face Trainer does); give a value")
        if key.refuse is not None:
            why = key.refuse(value)
            if why:
                raise DeepSpeedKeyError(f"{path}={_short(value)}: {why}")
        if key.keys is not None:
            _walk(value, key.keys, f"{path}.", notes)
        if key.status == NO_EFFECT:
            notes.append(f"accepted, no effect here: {path} ({key.note})")


def coerce(path: str, value: Any, kind: type) -> Any:
    """``value`` as DeepSpeed's pydantic model (lax mode) reads a ``kind`` field: ``"2"`` is 2,
    ``"true"`` / ``"on"`` / 1 are true, ``"1e-3"`` is 0.001; what it refuses is refused, naming the
    key. A JSON number or true/false of the right kind is returned as given (the reader's own checks
    follow), and a bool is never made a float (DeepSpeed's ``fp16.loss_scale`` refuses it too)."""
    if isinstance(value, bool):
        if kind is not int:
            return value
    elif isinstance(value, (int, float)) and kind is not bool:
        return value
    from pydantic import TypeAdapter, ValidationError  # only for the few values that need it

    try:
        return TypeAdapter(kind).validate_python(value)
    except ValidationError as e:
        why = e.errors()[0]["msg"]
        raise DeepSpeedKeyError(f"{path}={value!r}: DeepSpeed reads it as {kind.__name__} and refuses it ({why})") \
            from None


def _example(key: Key) -> str:
    first = next(iter(key.keys)) if key.keys else "enabled"
    return f'{{"{first}": ...}}'


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# value predicates used by keys.py -------------------------------------------------------------------
def refuse_true(why: str) -> Callable[[Any], str | None]:
    return lambda v: why if v is True else None


def refuse_enabled(why: str) -> Callable[[Any], str | None]:
    """A section refused when anything in it is enabled (``"enabled": true`` at any depth)."""
    return lambda v: why if _any_enabled(v) else None


def _any_enabled(value: Any) -> bool:
    if isinstance(value, dict):
        return value.get("enabled") is True or any(_any_enabled(v) for v in value.values())
    if isinstance(value, list):
        return any(_any_enabled(v) for v in value)
    return False


def refuse_unless(allowed, why: str) -> Callable[[Any], str | None]:
    return lambda v: None if v in allowed else why


# the manual's table (docs/deepspeed.md) -----------------------------------------------------------
def rows(table: Mapping[str, Key], prefix: str = ""):
    """``(key path, status, note)`` for every key of ``table``, sections before their keys."""
    for name, key in table.items():
        status = key.status + (f"; refused {key.refused_when}" if key.refused_when else "")
        yield f"{prefix}{name}", status, key.note
        if key.keys is not None:
            yield from rows(key.keys, f"{prefix}{name}.")


def markdown_table(table: Mapping[str, Key]) -> str:
    """The manual's table of every DeepSpeed key (``tests`` hold docs/deepspeed.md to it)."""
    lines = ["| DeepSpeed key | here | what zerotron does |", "|---|---|---|"]
    lines += [f"| `{path}` | {status} | {note} |" for path, status, note in rows(table)]
    return "\n".join(lines) + "\n"
