"""`ScopedValue`: a value made current for one block of code, the one way Spartron uses a ContextVar.

Why a context variable at all: a checkpoint replay finds its region's frame without threading it
through every layer call. (Communication buffers do not go this way: the DeepEP and copy-engine ops
take theirs as an opaque reference, which torch.compile passes into the graph; dynamo cannot trace a
ContextVar.) Each scope restores what was current before, so scopes nest, and a thread or task that
did not enter one sees None.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Generic, TypeVar

T = TypeVar("T")


class ScopedValue(Generic[T]):
    def __init__(self, name: str):
        self._var: ContextVar[T | None] = ContextVar(name, default=None)

    @contextlib.contextmanager
    def scope(self, value: T) -> Iterator[T]:
        """`value` is current inside the block; what was current before is restored after it."""
        token = self._var.set(value)
        try:
            yield value
        finally:
            self._var.reset(token)

    def get(self) -> T | None:
        """The current value, None outside every scope."""
        return self._var.get()
