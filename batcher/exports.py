"""Sampler weights written off the trainer's loop.

An RL loop publishes sampler weights every step (`save_weights_for_sampler`), and writing them
took the trainer about a sixth of its busy time (bench/adapter_scale.py): every tenant's pass
waited for every tenant's files. The trainer now only takes what is to be written
(`TrainerBackend.export`: a device-side copy of the adapter's slab rows, the optimizer state by
reference) and one writer thread writes it, while the loop goes on
with other work. What must hold meanwhile:

- Nothing changes a model's weights in place while its files are being written: before an
  optim_step or a load of that model the loop waits for its exports (`wait_for`). Passes only
  read weights (gradients are separate tensors), so they run alongside.
- A save is answered only once its files are written: the loop publishes, settles and keeps (or
  acknowledges) its stream entry when `finished` hands it back, in the order the saves were made.
  A crash meanwhile leaves the entry unanswered and unacknowledged, so the restarted trainer
  replays it like any other request since the model's snapshot.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Export:
    """One save in flight: the loop's own context (`context`) comes back with the written size."""

    model_id: str
    context: Any
    future: concurrent.futures.Future[Any]


class Exports:
    def __init__(self) -> None:
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="quilt-export")
        self._pending: list[Export] = []

    def __len__(self) -> int:
        return len(self._pending)

    def start(self, model_id: str, write: Callable[[], int], context: Any) -> Export:
        export = Export(model_id, context, self._writer.submit(write))
        self._pending.append(export)
        return export

    def finished(self) -> list[Export]:
        """Exports that are written (or failed), oldest first, no longer pending; `future.result()`
        gives the size or raises what the write raised."""
        done = [e.future.done() for e in self._pending]
        finished = [e for e, d in zip(self._pending, done) if d]
        self._pending = [e for e, d in zip(self._pending, done) if not d]
        return finished

    def wait_for(self, model_id: str | None = None) -> None:
        """Block until every export of `model_id` (of every model, with None) is written."""
        concurrent.futures.wait([e.future for e in self._pending if model_id in (None, e.model_id)])

    def close(self) -> None:
        self.wait_for()
        self._writer.shutdown()
