"""The schema's keys as the command line spells them: every dotted key, a section's keys, and what
a key holds, in words (for the lines that name a key)."""

from __future__ import annotations

import dataclasses
import typing

from trainer.config.schema import JobConfig

WANTED = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def group_keys(cls, key: str) -> list[str]:
    """The keys of the section `key` (dotted) of the dataclass `cls`; [] when it is a single key."""
    for name in key.split("."):
        cls = _dataclass_of(typing.get_type_hints(cls).get(name.split("[")[0])) if cls is not None else None
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
    base = next((a for a in typing.get_args(hint) if a is not type(None)), hint) if optional else hint
    words = WANTED.get(base) or ("a list" if typing.get_origin(base) is list else "of the schema's type")
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
    """The dataclass a field holds (itself, or inside Optional[...]), None for plain values and lists."""
    if dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) is typing.Union:
        return next((arg for arg in typing.get_args(hint) if dataclasses.is_dataclass(arg)), None)
    return None
