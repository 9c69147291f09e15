"""Optional GPU-only dependencies (DeepEP, Transformer Engine, ...), imported when a feature asks.

Nothing imports them at module level: a CPU install without them works until a user selects a backend
that needs one, and then gets an error naming the package and how to install it.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingDependencyError(ImportError):
    """An optional package a selected feature needs is not installed."""


def require(module_name: str, feature: str, install_hint: str) -> ModuleType:
    """Import `module_name` for `feature`, or raise naming the package and how to install it."""
    try:
        return importlib.import_module(module_name)
    except ImportError as err:
        raise MissingDependencyError(
            f"{feature} needs the Python package {module_name!r}, which is not installed or failed to import "
            f"({type(err).__name__}: {err}). Install it: {install_hint}"
        ) from err
