"""A value made once per process: what the adapters' group builders carry to workers is how to
make a tokenizer or an environment, never the made thing (a tokenizer, a dataset, a socket)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class PerProcess(Generic[T]):
    """``make()`` called on first use in each process; pickles as ``make`` alone."""

    def __init__(self, make: Callable[[], T]) -> None:
        self.make = make
        self._value: T | None = None
        self._lock = threading.Lock()

    def get(self) -> T:
        if self._value is None:
            with self._lock:
                if self._value is None:
                    self._value = self.make()
        return self._value

    def __getstate__(self) -> dict:
        return {"make": self.make}

    def __setstate__(self, state: dict) -> None:
        PerProcess.__init__(self, state["make"])
