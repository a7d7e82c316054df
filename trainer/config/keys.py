"""The schema's keys as the command line spells them: every dotted key, a section's keys, and what
a key holds, in words (for the lines that name a key)."""

from __future__ import annotations

import dataclasses
import difflib
import typing

from trainer.config.schema import JobConfig

WANTED = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def group_keys(cls, key: str) -> list[str]:
    """The keys of the section `key` (dotted) of the dataclass `cls`; [] when it is a single key."""
    for name in key.split("."):
        cls = (_dataclass_of(typing.get_type_hints(cls).get(name.split("[")[0])) if cls is not None
               else None)
    return [f.name for f in dataclasses.fields(cls)] if cls is not None else []


def wanted(cls, key: str) -> str:
    """What the field `key` (dotted) of the dataclass `cls` holds, in words."""
    hint = None
    for name in key.split("."):
        if cls is None:
            return "of the schema's type"
        hint = typing.get_type_hints(cls).get(name.split("[")[0])
        cls = _dataclass_of(hint)
    optional = typing.get_origin(hint) is typing.Union and type(None) in typing.get_args(hint)
    base = (next((a for a in typing.get_args(hint) if a is not type(None)), hint) if optional
            else hint)
    words = WANTED.get(base) or ("a list" if typing.get_origin(base) is list
                                 else "of the schema's type")
    return words + (" (or null)" if optional else "")


def schema_keys() -> set[str]:
    """Every dotted key of the job's schema, nested sections included."""
    return _fields(JobConfig, "")


def _fields(cls, prefix: str) -> set[str]:
    keys = set()
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        key = prefix + field.name
        keys.add(key)
        inner = _dataclass_of(hints[field.name])
        if inner is not None:
            keys |= _fields(inner, key + ".")
    return keys


def _dataclass_of(hint):
    """The dataclass a field holds (itself, or inside Optional[...]), None for plain values and
    lists."""
    if dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) is typing.Union:
        return next((arg for arg in typing.get_args(hint) if dataclasses.is_dataclass(arg)), None)
    return None


def nearest_key(key: str, keys: set[str]) -> str | None:
    """The known key most like `key`, as a whole or its section and its name each alike, one of the
    same name first: `val.path` is validation.path (the whole string alone made it data.path),
    `optim.lr` training.lr. None when none is near."""
    section, _, name = key.rpartition(".")

    def likeness(known: str) -> float:  # (0..2)
        known_section, _, known_name = known.rpartition(".")
        parts = (difflib.SequenceMatcher(None, section, known_section).ratio()
                 + difflib.SequenceMatcher(None, name, known_name).ratio())
        return max(parts, 2 * difflib.SequenceMatcher(None, key, known).ratio())

    candidates = sorted(k for k in keys if not key.startswith(k + "."))  # (not its own section)
    # A known name under another section (optim.lr: training.lr) before any other.
    same_name = [k for k in candidates if k.rpartition(".")[2] == name]
    best = max(same_name or candidates, key=likeness)
    return best if likeness(best) >= 1.2 else None
