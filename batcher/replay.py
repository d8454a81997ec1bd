"""The replay log: what a trainer keeps of each model's stream entries until a snapshot covers them,
and the rules by which it replays them (batcher.snapshots says why).

A model's entries stay unacknowledged (`hold`) from the request after its last snapshot on; a
snapshot is due after a create, a load and every `snapshot_every_steps`-th optimizer step
(`snapshot_due`), and once written the entries it covers are let go (`release`). A restarted or
adopting trainer re-runs the entries after the snapshot in seq_id order: those already answered
run again only for their effect on the model's state, and not at all when they have none
(`without_effect`). A restored model reads 'ready' again once its log has run (`recovered`).

Plain data and rules only: the worker acknowledges, snapshots and writes statuses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from core.consumer import Delivery
from core.work import WorkItem, WorkKind

# Answered requests whose effect is not part of a model's state: a replay skips them.
_NO_EFFECT = frozenset({WorkKind.FORWARD, WorkKind.SAVE_WEIGHTS, WorkKind.SAVE_WEIGHTS_FOR_SAMPLER,
                        WorkKind.SAVE_WEIGHTS_EXTERNAL, WorkKind.REJECTED})
# Barriers that replace a model's whole state: each is followed by a snapshot.
_REPLACE_STATE = frozenset({WorkKind.CREATE_MODEL, WorkKind.LOAD_WEIGHTS})


@dataclass
class ReplayLog:
    snapshot_every_steps: int = 1
    held: dict[str, list[str]] = field(default_factory=dict)  # model -> stream ids since its last snapshot
    # restored model -> the last seq_id of its replay log (None: nothing to replay)
    recovering: dict[str, int | None] = field(default_factory=dict)
    steps_since_snapshot: dict[str, int] = field(default_factory=dict)
    failed_before: set[str] = field(default_factory=set)  # replayed requests that had failed

    def note_finished(self, statuses: Mapping[str, str]) -> Mapping[str, str]:
        """Of the requests a restarted trainer read back, `statuses` names the finished ones
        ('done' or 'failed'); returns them (core.consumer.Finished). A request that failed left no
        gradient or step to replay (given up, refused, overflowed)."""
        self.failed_before.update(r for r, status in statuses.items() if status == "failed")
        return statuses

    def without_effect(self, d: Delivery) -> bool:
        """A replayed request whose answer stands and whose effect is not part of the model's state."""
        return d.finished and (d.item.request_id in self.failed_before or d.item.kind in _NO_EFFECT)

    def hold(self, model_id: str, stream_id: str) -> None:
        self.held.setdefault(model_id, []).append(stream_id)

    def release(self, model_id: str) -> list[str]:
        """The stream ids of `model_id` to acknowledge now (a snapshot covers them, or nothing of
        the model is left to replay)."""
        return self.held.pop(model_id, [])

    def snapshot_due(self, item: WorkItem) -> bool:
        """Whether the barrier `item`, just run, is followed by a snapshot of its model (counting
        the optimizer steps between snapshots)."""
        if item.kind is WorkKind.OPTIM_STEP:
            n = self.steps_since_snapshot.get(item.model_id, 0) + 1
            self.steps_since_snapshot[item.model_id] = n
            return n >= self.snapshot_every_steps
        return item.kind in _REPLACE_STATE

    def snapshotted(self, model_id: str) -> list[str]:
        """A snapshot of `model_id` was written: its step count restarts; returns the stream ids to
        acknowledge."""
        self.steps_since_snapshot[model_id] = 0
        return self.release(model_id)

    def recover(self, model_id: str, last_seq: int | None) -> None:
        """`model_id` was restored from a snapshot; its log runs up to `last_seq` (None: nothing)."""
        self.recovering[model_id] = last_seq

    def recovered(self, next_seq: Mapping[str, int]) -> list[str]:
        """The restored models whose replay log has run (their next seq_id, `next_seq`, is past
        it), which read 'ready' again; models `next_seq` no longer knows (deleted meanwhile) are
        just forgotten."""
        done = []
        for model_id, last in list(self.recovering.items()):
            if model_id not in next_seq:
                del self.recovering[model_id]
            elif last is None or next_seq[model_id] > last:
                del self.recovering[model_id]
                done.append(model_id)
        return done

    def forget(self, model_id: str) -> None:
        """`model_id` left this trainer (drained to another shard)."""
        self.held.pop(model_id, None)
        self.recovering.pop(model_id, None)
        self.steps_since_snapshot.pop(model_id, None)
