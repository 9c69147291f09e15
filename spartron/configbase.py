"""The base of every validated config section: unknown keys and wrong types are errors.

Lives at the package top so that layer, checkpointing and runtime configs share it without
import cycles (it depends on pydantic only).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

# Characters no string option may hold: a newline or carriage return can start a new command or
# directive in a generated script or log line, and a NUL truncates paths at the OS boundary.
_FORBIDDEN_CHARS = {"\n": "a newline", "\r": "a carriage return", "\0": "a NUL byte"}


def check_single_line(value: Any) -> Any:
    """Raise ValueError if a string in `value` (a str, or nested in lists / dict keys and values)
    holds a newline, carriage return or NUL; nested config sections check themselves."""
    if isinstance(value, str):
        for char, what in _FORBIDDEN_CHARS.items():
            if char in value:
                raise ValueError(f"must not contain {what}, got {value!r}")
    elif isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            check_single_line(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_single_line(key)
            check_single_line(item)
    return value


class ConfigSection(BaseModel):
    """A strict config section: no unknown keys, no silent coercion of wrong types, no inf/nan floats,
    and no string option (anywhere in a field's value) with a newline, carriage return or NUL."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, frozen=False,
                              allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _single_line_strings(cls, value: Any) -> Any:
        return check_single_line(value)
