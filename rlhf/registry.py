"""Name registries for swappable parts (DPO variants, advantage estimators, policy losses, ...).

A registry maps a name to a callable. Looking up an unknown name raises an error that lists every valid
name, so a typo in a config (``dpo.loss_type=sigmod``) is answered with the fix, not a KeyError.
"""

from __future__ import annotations

import difflib
from typing import Callable, Dict, Generic, Iterator, TypeVar

T = TypeVar("T")
F = TypeVar("F", bound=Callable)


class UnknownNameError(KeyError):
    """Raised for a name that is not registered; the message lists the valid names."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the plain sentence
        return str(self.args[0])


class Registry(Generic[T]):
    """A named collection of implementations of one kind (``kind`` is used in error messages)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: Dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@REGISTRY.register("sigmoid")``. Registering a name twice is an error."""

        def decorate(item: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = item
            return item

        return decorate

    def register_entry(self, name: str, entry: Callable[[F], T]) -> Callable[[F], F]:
        """Decorator for a function whose registry entry carries it with facts about it:
        ``@REGISTRY.register_entry("grpo", lambda fn: Estimator(fn, ...))`` registers ``entry(fn)`` under ``name``
        and returns ``fn`` itself, which its module keeps calling directly."""

        def decorate(fn: F) -> F:
            self.register(name)(entry(fn))
            return fn

        return decorate

    def get(self, name: str) -> T:
        if name not in self._items:
            close = difflib.get_close_matches(name, self._items, n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise UnknownNameError(f"unknown {self.kind} {name!r}.{hint} Valid names: {', '.join(sorted(self._items))}")
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))
