"""Which backend calls every rank of a trainer gang makes: marked where they are defined.

In a gang (`batcher.engine.gang`) rank 0 runs the loop and the other ranks follow: every call that
changes tensors or runs a collective must be made on every rank, in rank 0's order, or the gang
hangs in its next collective. Such a method carries `@collective()`. On rank 0 its backend has a
`Mirror` (the gang's `Leader`), and a marked call is handed to the other ranks before rank 0 makes
it; a marked call made inside another is part of it and is not handed on again. A single trainer
has no mirror and a marked call is an ordinary call. `collective_calls` reads the marks, so what
the followers make is derived from the class itself, and `unmarked` names the public methods that
are neither marked nor declared local: the test of the backend fails on those.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S", bound="Mirrored")

_MARK = "__quilt_collective__"


class Mirror(Protocol):
    """Rank 0's side of a gang: hands a marked call to the other ranks, then runs it here."""

    def call(self, name: str, run: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...


class Mirrored(Protocol):
    mirror: Mirror | None


def collective(*, followers: str | None = None
               ) -> Callable[[Callable[Concatenate[S, P], R]], Callable[Concatenate[S, P], R]]:
    """Mark a backend method as made by every rank of a gang. `followers`: the method the other
    ranks make in its place, where theirs differs (a save is written by rank 0 alone; the others
    only take part in gathering the shares, which is `export`)."""

    def mark(fn: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
        name = fn.__name__

        def call(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
            mirror = self.mirror
            if mirror is None:
                return fn(self, *args, **kwargs)
            result: R = mirror.call(name, functools.partial(fn, self), args, kwargs)
            return result

        functools.update_wrapper(call, fn)
        setattr(call, _MARK, followers or name)
        return call

    return mark


def collective_calls(cls: type) -> dict[str, str]:
    """Every marked method of `cls`, by name: the method the other ranks make for it."""
    return {name: getattr(fn, _MARK) for name, fn in inspect.getmembers(cls, callable) if hasattr(fn, _MARK)}


def unmarked(cls: type, local: frozenset[str]) -> list[str]:
    """The public methods of `cls` that are neither marked collective nor in `local`."""
    marked = collective_calls(cls)
    return sorted(name for name, _ in inspect.getmembers(cls, inspect.isfunction)
                  if not name.startswith("_") and name not in marked and name not in local)
