"""The base of every validated config section: unknown keys and wrong types are errors.

Lives at the package top so that layer, checkpointing and runtime configs share it without
import cycles (it depends on pydantic only).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

# Characters no string option may hold: a newline or carriage return can start a new command or
# directive in a generated script or log line, a NUL truncates paths at the OS boundary, and the
# other control characters (tab aside) cannot be written back to TOML (the frozen config of a job).
_FORBIDDEN_CHARS = {"\n": "a newline", "\r": "a carriage return", "\0": "a NUL byte"}
# also C1 controls (U+0085 ends a line for Python), the Unicode line and paragraph separators, and the
# bidirectional overrides that make a name read differently from what it is (in a log or a job list)
_CONTROL = frozenset(chr(c) for c in [*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029, *range(0x202A, 0x202F),
                                      *range(0x2066, 0x206A)]) - {"\t"}


class ConfigError(ValueError):
    """A config that cannot be used; the message names the dotted key. Defined here, at the package
    top, so that every floor (data below runtime included) raises the one error the CLI reports."""


_INT_LIMIT = 2**63  # every integer option fits a signed 64-bit integer (torch, numpy, JSON readers)


def check_plain_value(value: Any) -> Any:
    """Raise ValueError if a string in `value` (a str, or nested in lists / dict keys and values)
    holds a newline, carriage return or NUL, or an integer does not fit 64 bits; nested config
    sections check themselves."""
    if isinstance(value, str):
        for char, what in _FORBIDDEN_CHARS.items():
            if char in value:
                raise ValueError(f"must not contain {what}, got {value!r}")
        if not _CONTROL.isdisjoint(value):
            raise ValueError(f"must not contain control characters, got {value!r}")
    elif isinstance(value, int) and not isinstance(value, bool):
        if not -_INT_LIMIT <= value < _INT_LIMIT:
            raise ValueError(f"must fit a signed 64-bit integer, got {value}")
    elif isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            check_plain_value(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_plain_value(key)
            check_plain_value(item)
    return value


class ConfigSection(BaseModel):
    """A strict config section: no unknown keys, no silent coercion of wrong types, no inf/nan floats,
    no integer beyond 64 bits, and no string option (anywhere in a field's value) with a newline,
    carriage return or NUL."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, frozen=False,
                              allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _plain_values(cls, value: Any) -> Any:
        return check_plain_value(value)
