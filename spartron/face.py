"""A package face that imports a name's module on first use.

`spartron.runtime` lists `Trainer`, `RunConfig`, ... as its public names, but `spartron --version` and a
one-line config error import only `spartron.runtime.config`: a face that imported every module eagerly
would make each of them pay for the Trainer's imports.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_face(package: str, names: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(`__getattr__`, `__dir__`) for `package`, given public name -> the submodule (under `package`)
    that defines it; a name not listed is an AttributeError, as for any module."""
    table = dict(names)

    def get(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    def listing() -> list[str]:
        return sorted(table)

    return get, listing
