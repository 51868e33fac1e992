"""A registry of classes by name, for the parsers a flag chooses by name
(``--tool-call-parser``, ``--reasoning-parser``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T", bound=type)


class ClassRegistry(Generic[T]):
    """Names -> classes. ``what``: the kind, for errors; ``field``: the setting that names
    one (an unknown name is a ``ValueError`` naming it, listing the names)."""

    def __init__(self, what: str, field: str) -> None:
        self.what, self.field = what, field
        self._classes: dict[str, T] = {}

    def register(self, *names: str) -> Callable[[T], T]:
        """Class decorator: the class is offered under ``names``."""

        def wrap(cls: T) -> T:
            for name in names:
                if name in self._classes and self._classes[name] is not cls:
                    raise ValueError(f"{self.what} {name!r} is already registered")
                self._classes[name] = cls
            return cls

        return wrap

    def names(self) -> tuple[str, ...]:
        return tuple(self._classes)

    def get(self, name: str) -> T:
        if name not in self._classes:
            raise ValueError(f"{self.field} must be one of {self.names()}, got {name!r}")
        return self._classes[name]
