"""Progress bars for long training loops (tqdm, written to stderr)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TypeVar

from tqdm import tqdm

__all__ = ["progress"]

T = TypeVar("T")


def progress(iterable: Iterable[T], desc: str | None = None, total: int | None = None) -> tqdm[T]:
    """Wrap ``iterable`` in a progress bar on stderr.

    Iterate over the returned bar as over ``iterable``; show the latest loss with
    ``bar.set_postfix(loss=result.loss)``::

        bar = quilt.progress(range(steps), desc="train")
        for step in bar:
            result = tc.train_step(batches[step])
            bar.set_postfix(loss=f"{result.loss:.3f}")

    ``total`` is only needed when ``iterable`` has no ``len()`` (e.g. a generator).
    """
    # sys.stderr is looked up per call so redirected or captured stderr is honoured.
    return tqdm(iterable, desc=desc, total=total, file=sys.stderr, dynamic_ncols=True)
