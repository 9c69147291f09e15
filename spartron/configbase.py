"""The base of every validated config section: unknown keys and wrong types are errors.

Lives at the package top so that layer, checkpointing and runtime configs share it without
import cycles (it depends on pydantic only).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigSection(BaseModel):
    """A strict config section: no unknown keys, no silent coercion of wrong types."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, frozen=False)
