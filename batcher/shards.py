"""A trainer shard's membership (QUILT_TRAINER_SHARDS above 1): which models are this shard's, and
moving stream entries to the shard that holds their model.

Each shard holds the models placed on it (scaleout.placement) and reads its own stream. What
arrives for a model placed elsewhere is forwarded there; a model re-placed onto this shard is
adopted (restored from its snapshot, by the worker); a peer whose liveness key lapsed has its
models re-placed and its stream's entries moved to their new shards; a shard asked to drain hands
its models on. Without shards (one trainer per base), only the strays of a former sharded run are
gathered in.

This object reads placement (through `db_call`, which waits out a Postgres restart) and moves
entries in Redis; what the worker must do to its own state comes back as plain answers
(`Sorted`, lists of model ids), so these rules are tested with a fake database call and Redis.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from core import health, queue
from core.consumer import Delivery
from core.work import MalformedWork, WorkItem
from scaleout import placement

log = logging.getLogger("quilt.trainer.shards")


@dataclass(frozen=True)
class Sorted:
    """Deliveries sorted by owner: `kept` stay here; of their models, `creating` wait for their
    create to run here, and `adopt` were re-placed here and are to be restored."""

    kept: list[Delivery]
    creating: set[str]
    adopt: list[str]


class ShardMembership:
    def __init__(self, *, redis: Any, base_model: str, shard: str | None, shards: int, stream: str,
                 db_call: Callable[..., Any]) -> None:
        self.redis = redis
        self.base_model = base_model
        self.shard = shard
        self.shards = shards
        self.stream = stream  # this trainer's own stream
        self.db_call = db_call  # db_call(record, *args): a core.records-style call on the worker's connection

    def fenced(self) -> bool:
        """Whether a peer took this shard for dead and re-placed its models (it must restart)."""
        if not self.shard:
            return False
        return bool(self.redis.exists(placement.fence_key(self.base_model, self.shard)))

    def clear_fence(self) -> None:
        """At start: what is still placed here is restored by this start, so a fence is moot."""
        if self.shard:
            self.redis.delete(placement.fence_key(self.base_model, self.shard))

    def sort(self, deliveries: list[Delivery], local: Callable[[str], bool]) -> Sorted:
        """Of the deliveries for models this shard does not hold (`local` says which it does):
        forward those placed on another shard; keep the rest, naming the models to adopt and those
        whose create has not run yet."""
        if not self.shard:
            return Sorted(deliveries, set(), [])
        unknown = sorted({d.item.model_id for d in deliveries if not local(d.item.model_id)})
        if not unknown:
            return Sorted(deliveries, set(), [])
        owners = self.owners(unknown)
        creating, adopt, kept = set(), [], []
        for d in deliveries:
            model_id = d.item.model_id
            shard, status = owners.get(model_id, (None, "deleted"))
            if model_id in owners and status in placement.LIVE_STATUSES and shard != self.shard:
                queue.move(self.redis, self.stream, queue.TRAIN_GROUP, d.stream_id,
                           queue.train_stream(self.base_model, shard))
                continue
            if model_id in owners and status == "creating":
                creating.add(model_id)
            elif model_id in owners and status in placement.LIVE_STATUSES and model_id not in adopt:
                adopt.append(model_id)
            kept.append(d)
        return Sorted(kept, creating, adopt)

    def owners(self, model_ids: list[str]) -> dict[str, tuple[str | None, str]]:
        """model -> (its shard, its status); a model gone reads (None, 'deleted'), and a live one
        not placed yet (from before shards) is placed now."""
        found = self.db_call(placement.owners, model_ids)
        out = {}
        for model_id in model_ids:
            shard, status = found.get(model_id, (None, "deleted"))
            if status in placement.LIVE_STATUSES and shard is None:
                shard = self.db_call(placement.place_unplaced, self.redis, self.base_model, model_id, self.shards)
            out[model_id] = (shard, status)
        return out

    def placed_here(self, local: Callable[[str], bool]) -> list[str]:
        """The models re-placed onto this shard that no call has brought yet (idle ones), to adopt
        so they read 'ready' again without waiting for their next call."""
        return [m for m in self.db_call(placement.recovering_on, self.base_model, self.shard) if not local(m)]

    def take_over_dead(self) -> None:
        """Re-place the models of peers whose liveness key lapsed (or that are past the shard count)
        and move their streams' entries (and the unsharded stream's, from before shards) to the
        models' shards, each entry once."""
        for name in queue.shard_names(self.shards) + self.db_call(placement.stray_shards, self.base_model,
                                                                  self.shards):
            stream = queue.train_stream(self.base_model, name)
            if name == self.shard or self._alive(stream, name):
                continue
            if self.db_call(placement.models_on, self.base_model, name):
                moves = self.db_call(placement.replace_dead, self.redis, self.base_model, name, self.shards,
                                     lambda stream=stream, name=name: not self._alive(stream, name))
                if moves:
                    log.warning("shard %s stopped: its %d models re-placed: %s", name, len(moves), moves)
            if not self._alive(stream, name):
                self.forward(stream)
        self.forward(queue.train_stream(self.base_model))

    def gather_strays(self) -> int:
        """Without shards: move into this trainer's stream the entries of shard streams whose
        trainers have stopped (QUILT_TRAINER_SHARDS lowered to 1): queued calls, and the replay
        logs since the snapshots this trainer restored its models from. A shard still running (a
        rollout's old pod) keeps its stream until its liveness key lapses. Returns how many moved."""
        moved = 0
        for name in self.db_call(placement.stray_shards, self.base_model, 1):
            stream = queue.train_stream(self.base_model, name)
            if not self._alive(stream, name):
                moved += self.forward(stream)
        if moved:
            log.warning("%d requests moved here from the streams of trainer shards that no longer run", moved)
        return moved

    def to_drain(self) -> list[str]:
        """`quilt trainers drain`: the models placed here, now placed on the open shards (their
        entries are then moved with `forward`); empty when not draining or nowhere to go."""
        if not self.db_call(placement.is_draining, self.base_model, self.shard):
            return []
        mine = self.db_call(placement.models_on, self.base_model, self.shard)
        if not mine:
            return []
        moves = self.db_call(placement.move_off, self.redis, self.base_model, self.shard, mine, self.shards)
        if not moves:
            log.warning("shard %s is draining but no other shard is open to take its %d models", self.shard, len(mine))
        return list(moves)

    def forward(self, source: str, which: Callable[[str], bool] = lambda model_id: True, page: int = 256) -> int:
        """Move the entries of `source` whose model `which` selects to the streams of the shards
        their models are placed on (entries of models gone come here, to be failed as lost);
        without shards, all of them here. Returns how many moved."""
        moved, after = 0, "-"
        while entries := self.redis.xrange(source, min=after, max="+", count=page):
            ids_of = {}
            for entry_id, fields in entries:
                try:
                    ids_of[entry_id] = WorkItem.from_fields(fields).model_id
                except MalformedWork:
                    ids_of[entry_id] = ""
            ids_of = {entry_id: model_id for entry_id, model_id in ids_of.items() if which(model_id)}
            owners = self.owners(sorted({m for m in ids_of.values() if m})) if self.shard else {}
            for entry_id, model_id in ids_of.items():
                shard, status = owners.get(model_id, (None, "deleted"))
                destination = queue.train_stream(self.base_model, shard if status in placement.LIVE_STATUSES
                                                 else self.shard)
                if destination != source and queue.move(self.redis, source, queue.TRAIN_GROUP, entry_id, destination):
                    moved += 1
            last = entries[-1][0]
            after = "(" + (last.decode() if isinstance(last, bytes) else last)
        return moved

    def _alive(self, stream: str, name: str) -> bool:
        return bool(self.redis.exists(health.consumer_key(stream, name)))
