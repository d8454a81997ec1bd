"""In-memory view of queued work, per training model, in `seq_id` order.

Requests can arrive out of order (the SDK sends the first chunk of a forward_backward last); they
wait here until every earlier `seq_id` of their model has run. A `seq_id` that never comes (a
client that died between two calls) would hold the requests behind it, and the tenant's in-flight
quota, forever: after a deadline they are given up (`give_up_stalled`), and the missing id, should
it come after all, is refused as late.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from batcher.policy import ModelQueue, Pending
from core.consumer import Delivery
from core.errors import UserError
from core.work import WorkItem, WorkKind


class Added(enum.Enum):
    QUEUED = "queued"
    DUPLICATE = "duplicate"  # a redelivery of work already queued or run
    LATE = "late"  # a seq_id given up by give_up_stalled


@dataclass(frozen=True)
class Stalled:
    """A model whose queued requests waited too long for `missing` (the seq_id before them)."""

    model_id: str
    missing: int
    given_up: list[Delivery]

    def error(self, d: Delivery, deadline_s: float) -> UserError:
        """The answer of `d`, one of the requests given up."""
        return UserError(f"seq_id {self.missing} of model {self.model_id!r} never arrived within {deadline_s:g} s, "
                         f"so this request (seq_id {d.item.seq_id}), which must run after it, was not run; later "
                         "calls of the model run normally", field="seq_id")


def late_error(item: WorkItem, deadline_s: float) -> UserError:
    """The answer of a request that came after the ones behind it were given up (Added.LATE)."""
    return UserError(f"seq_id {item.seq_id} of model {item.model_id!r} arrived after the requests behind it were "
                     f"given up waiting for it ({deadline_s:g} s); send it again with a new seq_id", field="seq_id")


@dataclass
class ModelQueues:
    next_seq: dict[str, int] = field(default_factory=dict)
    pending: dict[str, dict[int, Delivery]] = field(default_factory=dict)
    arrived: dict[str, float] = field(default_factory=dict)  # request id -> when it was queued (monotonic)
    # model -> (first, last, seq_ids queued among them): the ranges given up by give_up_stalled.
    # Ranges, not sets: a client may skip from seq_id 2 to 2**31 - 1.
    given_up: dict[str, list[tuple[int, int, frozenset[int]]]] = field(default_factory=dict)

    def add(self, delivery: Delivery, *, now: float | None = None) -> Added:
        """Queue a delivered item."""
        item = delivery.item
        if item.kind is WorkKind.CREATE_MODEL:
            self.next_seq[item.model_id] = 0
        expected = self.next_seq.get(item.model_id)
        if expected is not None and item.seq_id < expected:
            late = any(first <= item.seq_id <= last and item.seq_id not in queued
                       for first, last, queued in self.given_up.get(item.model_id, ()))
            return Added.LATE if late else Added.DUPLICATE
        slot = self.pending.setdefault(item.model_id, {})
        if item.seq_id in slot:
            return Added.DUPLICATE
        slot[item.seq_id] = delivery
        self.arrived[item.request_id] = time.monotonic() if now is None else now
        return Added.QUEUED

    def give_up_stalled(self, deadline_s: float, *, now: float | None = None) -> list[Stalled]:
        """Take out the requests of every model whose next seq_id is missing while a later one has
        waited `deadline_s`; the model's sequence moves past them, so its next calls run."""
        now = time.monotonic() if now is None else now
        out = []
        for model_id, slot in self.pending.items():
            expected = self.next_seq.get(model_id)
            if not slot or expected is None or expected in slot:
                continue
            if now - min(self.arrived[d.item.request_id] for d in slot.values()) < deadline_s:
                continue
            last = max(slot)
            self.given_up.setdefault(model_id, []).append((expected, last, frozenset(slot)))
            waiting = [slot[s] for s in sorted(slot)]
            for d in waiting:
                self.arrived.pop(d.item.request_id, None)
            slot.clear()
            self.next_seq[model_id] = last + 1
            out.append(Stalled(model_id, expected, waiting))
        return out

    def resume(self, model_id: str, *, next_seq: int) -> None:
        """A model restored from a snapshot: its sequence goes on from `next_seq`."""
        self.next_seq[model_id] = next_seq

    def last_seq(self, model_id: str, *, finished: bool) -> int | None:
        """The highest seq_id queued for `model_id` among deliveries whose `finished` flag is as
        given (finished ones are a restored model's replay log), or None."""
        seqs = [seq for seq, d in self.pending.get(model_id, {}).items() if d.finished == finished]
        return max(seqs) if seqs else None

    def runnable(self) -> bool:
        """Whether some model's next request is here (so a round would run something)."""
        return any(seq in self.pending.get(model_id, ()) for model_id, seq in self.next_seq.items())

    def knows(self, model_id: str) -> bool:
        return model_id in self.next_seq

    def snapshot(self) -> list[ModelQueue]:
        out = []
        for model_id, slot in self.pending.items():
            if not slot or model_id not in self.next_seq:
                continue
            items = tuple(
                Pending(e.item.request_id, model_id, e.item.tenant_id, e.item.seq_id, e.item.kind, e.item.n_tokens)
                for _, e in sorted(slot.items())
            )
            out.append(ModelQueue(model_id, self.next_seq[model_id], items))
        return out

    def take(self, p: Pending) -> Delivery:
        """Remove a planned request and advance its model's sequence."""
        entry = self.pending[p.model_id].pop(p.seq_id)
        self.next_seq[p.model_id] = p.seq_id + 1
        self.arrived.pop(p.request_id, None)
        return entry

    def drop_model(self, model_id: str) -> list[Delivery]:
        self.next_seq.pop(model_id, None)
        self.given_up.pop(model_id, None)
        dropped = list(self.pending.pop(model_id, {}).values())
        for d in dropped:
            self.arrived.pop(d.item.request_id, None)
        return dropped

    def depth(self) -> int:
        return sum(len(s) for s in self.pending.values())
