"""In-memory view of queued work, per training model, in `seq_id` order.

Requests can arrive out of order (the SDK sends the first chunk of a forward_backward last); they
wait here until every earlier `seq_id` of their model has run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batcher.policy import ModelQueue, Pending
from core.consumer import Delivery
from core.work import WorkKind


@dataclass
class ModelQueues:
    next_seq: dict[str, int] = field(default_factory=dict)
    pending: dict[str, dict[int, Delivery]] = field(default_factory=dict)

    def add(self, delivery: Delivery) -> bool:
        """Queue a delivered item; False if it duplicates one already queued or already run."""
        item = delivery.item
        if item.kind is WorkKind.CREATE_MODEL:
            self.next_seq[item.model_id] = 0
        expected = self.next_seq.get(item.model_id)
        if expected is not None and item.seq_id < expected:
            return False
        slot = self.pending.setdefault(item.model_id, {})
        if item.seq_id in slot:
            return False
        slot[item.seq_id] = delivery
        return True

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
        return entry

    def drop_model(self, model_id: str) -> list[Delivery]:
        self.next_seq.pop(model_id, None)
        return list(self.pending.pop(model_id, {}).values())

    def depth(self) -> int:
        return sum(len(s) for s in self.pending.values())
