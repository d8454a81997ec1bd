"""Captured passes: a micro-batch's forward, loss and backward replayed from a CUDA graph per bucket.

A fused pass launches thousands of small kernels (every layer's base GEMMs, shrink and expand, norms,
attention, the loss); on a large GPU the host cannot issue them as fast as the device runs them.
A CUDA graph records them once and replays them in one launch. What a graph needs, the trainer's
pass already is: nothing read back inside it (`tests/test_fused_step.py`), every input in one bundle
(`batcher.engine.transfer`); what it adds is fixed shapes and addresses. Micro-batches are padded to a
bucket (`batcher.engine.buckets`) whose bundle signature (its record's structure, every tensor's dtype and shape) is the
graph's key; each key keeps one static device buffer of that signature, and a micro-batch is run by
copying its bundle into that buffer and replaying.

Per key: the first micro-batch runs eagerly on the static buffer (on a side stream: the warm-up
CUDA graphs ask for, and a real result); the second is captured and replayed; the rest replay.
Warm-up and capture see the first micro-batch's host objects (its routes, loss plan, packed rows),
so everything the device work decides must come from the static buffer, never from those objects:
a captured route groups every run (`Route.static`), packed rows are masked by device segments,
loss sizes are the bucket's. `emulate` runs that same sequence eagerly on any device (the CPU's
tests): a replay then calls the first micro-batch's step again on the static buffer refilled, which
gives another micro-batch's results only if nothing of the first leaked into it.

Slabs that grow or are freed move (`MultiLoraModel.generation`): every graph is dropped then. At
most `limit` graphs are kept (least recently used dropped first), sharing one memory pool.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from batcher.engine.transfer import Bundle

log = logging.getLogger("quilt.trainer.graphs")

T = TypeVar("T")  # the record a bundle carries (batcher.engine.plan.PassTensors)

# What a bound step returns: the micro-batch's values for the host and the requests it poisoned.
Step = Callable[[], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class _Entry:
    buffer: torch.Tensor  # the static inputs: a bundle of the key's signature
    poisoned: torch.Tensor  # static: the requests poisoned before this micro-batch
    step: Step
    state: str = "warm"  # warm (ran eagerly once), captured, eager (capture refused)
    graph: torch.cuda.CUDAGraph | None = None
    outputs: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class Graphs:
    device: torch.device
    limit: int = 16
    emulate: bool = False  # replay by calling the step again (any device; tests)
    entries: OrderedDict[tuple[Any, ...], _Entry] = field(default_factory=OrderedDict)
    generation: int = -1
    counts: Counter[str] = field(default_factory=Counter)  # warm, captured, replayed, eager, dropped
    _pool: Any = None  # the graphs' shared memory pool (a CUDA pool handle)

    def run(self, key: tuple[Any, ...], bundle: Bundle[T], poisoned: torch.Tensor, generation: int,
            bind: Callable[[T, torch.Tensor], Step]) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch of this `bundle` (its bucket's `key`): (values, poisoned after it).
        `bind(static inputs, static poisoned)` makes the step of the key's first micro-batch."""
        if generation != self.generation:
            self.counts["dropped"] += len(self.entries)
            self.entries.clear()
            self.generation = generation
        entry = self.entries.get(key)
        if entry is None:
            buffer = bundle.buffer(self.device)
            static_poisoned = poisoned.clone()
            entry = _Entry(buffer, static_poisoned, bind(bundle.views(buffer), static_poisoned))
            self.entries[key] = entry
            while len(self.entries) > self.limit:
                self.entries.popitem(last=False)
                self.counts["dropped"] += 1
            self.counts["warm"] += 1
            return self._warm(entry)
        self.entries.move_to_end(key)
        bundle.copy_into(entry.buffer)
        entry.poisoned.copy_(poisoned)
        if entry.state == "warm":
            self._capture(entry)
        if entry.state == "eager":
            self.counts["eager"] += 1
            return entry.step()
        self.counts["replayed"] += 1
        if self.emulate:
            values, after = entry.step()
        else:
            graph, outputs = entry.graph, entry.outputs
            if graph is None or outputs is None:
                raise RuntimeError("a captured bucket has no graph")
            graph.replay()
            values, after = outputs
        # The next replay of this graph overwrites its outputs: the pass keeps copies.
        return values.clone(), after.clone()

    def _warm(self, entry: _Entry) -> tuple[torch.Tensor, torch.Tensor]:
        if self.device.type != "cuda":
            return entry.step()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            values, after = entry.step()
        main = torch.cuda.current_stream(self.device)
        main.wait_stream(side)
        for t in (values, after):  # made on the side stream, read on the main one
            t.record_stream(main)
        return values, after

    def _capture(self, entry: _Entry) -> None:
        if self.emulate:
            entry.state = "captured"
            self.counts["captured"] += 1
            return
        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # thread_local: an export's writer thread may copy tensors to the host meanwhile
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                entry.outputs = entry.step()
            entry.graph, entry.state = graph, "captured"
            self.counts["captured"] += 1
        except Exception as exc:  # noqa: BLE001 - a pass that cannot be captured still runs, eagerly
            log.warning("a pass bucket could not be captured (%s: %s); it runs eagerly", type(exc).__name__, exc)
            entry.state, entry.graph, entry.outputs = "eager", None, None
