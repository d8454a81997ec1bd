"""The trainer worker: reads its base model's stream, plans rounds, runs them, records results.

The loop only moves data: stream (core.consumer) -> ModelQueues -> plan_round (pure) -> LoraBackend
-> results to Redis (futures) and Postgres (request rows, checkpoints), then acknowledges the
stream entries. Barriers (everything but the fused pass) dispatch through a kind -> handler table.

Run: `python -m batcher.worker` (the embedded launcher does this).
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import psycopg
import torch

from batcher import heap
from batcher.backend import LoraBackend, PassRequest
from batcher.exports import Exports
from batcher.policy import FairShare, RoundPlan, plan_round
from batcher.queues import Added, ModelQueues
from batcher.snapshots import SnapshotStore
from billing.ledger import settle
from billing.pricing import training_units
from core import (
    catalog,
    checkpoint_store,
    db,
    faults,
    health,
    ids,
    memory_plan,
    placement,
    queue,
    records,
    redis_client,
    run_metrics,
    stores,
)
from core.checkpoint_files import EXTERNAL_KIND, SAMPLER_KIND, TRAINING_KIND
from core.consumer import Delivery, StreamConsumer
from core.errors import Conflict, QuiltError, ServerError, UserError
from core.settings import get_api_settings, get_core_settings, get_trainer_settings
from core.work import (
    CreateModel,
    LoadWeights,
    MalformedWork,
    OptimStep,
    Rejected,
    SaveWeights,
    WorkItem,
    WorkKind,
)

log = logging.getLogger("quilt.trainer")

T = TypeVar("T")


# A trainer's round can take seconds, and its liveness key is refreshed between rounds only: it is
# kept long enough that a busy trainer is never taken for a dead one. A consumer without a key has
# its entries taken once they have been idle RECLAIM_IDLE_MS, checked every RECLAIM_EVERY_S.
LIVENESS_TTL_S = 60
RECLAIM_IDLE_MS = 15_000
RECLAIM_EVERY_S = 5.0
EXPORT_POLL_MS = 5
RECENT_TOKENS_S = 60.0  # the window of a shard's "recent tokens" (core.placement's load)
RESTART_EXIT_CODE = 75  # a fenced shard exits so its supervisor starts it afresh


class TrainerWorker:
    def __init__(self, *, base_model: str, backend: LoraBackend, redis, db_url: str, consumer: str,
                 block_ms: int, result_ttl_s: int, token_budget: int | None = None, offload_idle_s: float = 300.0,
                 stats_history: int = 1000, seq_gap_deadline_s: float = 300.0,
                 snapshots: SnapshotStore | None = None, snapshot_every_steps: int = 1,
                 shard: str | None = None, shards: int = 1, takeover_s: int = 20):
        self.base_model = base_model
        # Trainer shards (QUILT_TRAINER_SHARDS above 1): this worker holds the models placed on
        # `shard` (core.placement), reads that shard's stream, forwards what arrives for models
        # placed elsewhere, restores models re-placed onto it, and re-places a dead peer's models.
        self.shard = shard
        self.shards = shards
        self.backend = backend
        self.redis = redis
        self.db_url = db_url
        self.block_ms = block_ms
        self.token_budget = token_budget
        self.offload_idle_s = offload_idle_s
        self.stats_history = stats_history
        self.seq_gap_deadline_s = seq_gap_deadline_s
        # Durable state (batcher.snapshots): a model's stream entries are kept, unacknowledged, until
        # a snapshot covers them. Without a store, models live in memory only (lost on restart).
        self.snapshots = snapshots
        self.snapshot_every_steps = snapshot_every_steps
        self.held: dict[str, list[str]] = {}  # model -> stream ids since its last snapshot
        self.recovering: dict[str, int | None] = {}  # restored model -> last seq_id of its replay log
        self._steps_since_snapshot: dict[str, int] = {}
        self._failed_before: set[str] = set()  # replayed requests that had failed
        stream = queue.train_stream(base_model, shard)
        self.consumer = StreamConsumer(redis, stream=stream, group=queue.TRAIN_GROUP,
                                       consumer=shard or consumer, settle=self._settle, result_ttl_s=result_ttl_s,
                                       liveness_ttl_s=takeover_s if shard else LIVENESS_TTL_S,
                                       reclaim_idle_ms=RECLAIM_IDLE_MS, what="trained", finished=self._finished_ids)
        self.queues = ModelQueues()
        self.exports = Exports()  # sampler weights being written off the loop (batcher.exports)
        self.store = checkpoint_store.get_store()  # where checkpoints are written and read from
        # A shard's liveness key is kept by its heartbeat thread: a long round never looks like death.
        self.heartbeat = health.Heartbeat(
            redis, health.trainer_key(base_model, shard),
            also=((health.consumer_key(stream, shard), takeover_s),) if shard else ())
        self._recent_tokens: deque[tuple[float, int]] = deque()  # (when, tokens) of recent passes
        self.deficits: dict[str, float] = {}  # fair-share state carried between rounds
        self._weights: dict[str, float] = {}
        self._weights_at = 0.0
        self._reclaimed_at = time.monotonic()
        self.stopping = False
        self.stats = {"rounds": 0, "requests": 0, "busy_s": 0.0, "wait_s": 0.0, "tokens": 0, "padded_tokens": 0,
                      "models_fused": 0, "tenants_fused": 0, "fused_rounds": 0, "started_at": time.time()}
        # Barriers run one model's request alone, in seq_id order: kind -> handler.
        self._barriers: dict[WorkKind, Callable[[WorkItem], dict]] = {
            WorkKind.CREATE_MODEL: self._create,
            WorkKind.OPTIM_STEP: self._optim_step,
            WorkKind.SAVE_WEIGHTS: self._save,  # SAVE_WEIGHTS_FOR_SAMPLER: _start_export, off the loop
            WorkKind.SAVE_WEIGHTS_EXTERNAL: self._save,
            WorkKind.LOAD_WEIGHTS: self._load,
            WorkKind.REJECTED: self._rejected,
        }

    # ------------------------------------------------------------------ setup

    def _db(self) -> psycopg.Connection:
        self._conn = db.live_connection(getattr(self, "_conn", None), self.db_url,
                                        db.session_name("trainer", self.shard, self.base_model) if self.shard else "")
        return self._conn

    def _db_call(self, record: Callable[..., T], *args, **kwargs) -> T:
        """`record(connection, *args, **kwargs)` (an idempotent read or write of core.records) on this
        worker's connection, waiting out a Postgres restart (core.stores) instead of failing the
        round it is part of."""
        return stores.until_reachable(lambda: record(self._db(), *args, **kwargs), record.__name__)

    def prepare(self) -> None:
        self.consumer.ensure_group()
        self.consumer.heartbeat()
        if self.shard:  # this start restores only what is still placed here: a fence is moot
            self.redis.delete(placement.fence_key(self.base_model, self.shard))
        restored = self._restore()
        lost = records.mark_models_lost(self._db(), self.base_model, keep=restored, shard=self.shard)
        if restored:
            log.info("%d models restored from their snapshots", len(restored))
        if lost:
            log.warning("%d models of a previous trainer process are lost (no snapshot)", lost)
        # Our own unacknowledged entries from before a crash come back first: queued work, and the
        # replay log of every restored model since its snapshot; without shards, then those the
        # shards of a larger QUILT_TRAINER_SHARDS left in their streams.
        self._ingest(self.consumer.read(own_pending=True))
        if not self.shard and self._gather_strays():
            while arrived := self.consumer.read():
                self._ingest(arrived)
        self.recovering = {model_id: self.queues.last_seq(model_id, finished=True) for model_id in restored}
        self._mark_recovered()

    def _restore(self) -> list[str]:
        if self.snapshots is None:
            return []
        restored = []
        for model_id in placement.claim_own(self._db(), self.base_model, self.shard):
            try:
                seq_id = self.snapshots.restore(self.backend, model_id)
            except Exception:
                log.exception("snapshot of %s could not be loaded", model_id)
                self.backend.delete(model_id)
                continue
            if seq_id is not None:
                self.queues.resume(model_id, next_seq=seq_id + 1)
                restored.append(model_id)
        return restored

    def _mark_recovered(self) -> None:
        """Restored models whose replay log has run are 'ready' again."""
        for model_id, last_replayed in list(self.recovering.items()):
            if not self.queues.knows(model_id):  # deleted meanwhile
                del self.recovering[model_id]
            elif last_replayed is None or self.queues.next_seq[model_id] > last_replayed:
                self._db_call(records.set_model_status, model_id, "ready")
                del self.recovering[model_id]

    def _finished_ids(self, request_ids: list[str]) -> set[str]:
        rows = self._db().execute("SELECT id, status FROM requests WHERE id = ANY(%s) AND status IN ('done', 'failed')",
                                  (request_ids,)).fetchall()
        # A request that failed left no gradient or step to replay (given up, refused, overflowed).
        self._failed_before.update(r["id"] for r in rows if r["status"] == "failed")
        return {r["id"] for r in rows}

    # ------------------------------------------------------------------ loop

    def run_forever(self) -> None:
        self.prepare()
        self.heartbeat.start()
        log.info("trainer for %s ready", self.base_model)
        try:
            while not self.stopping:
                self.step()
            self.exports.wait_for()
            self._finish_exports()
        finally:
            self.exports.close()
            self.heartbeat.stop()

    def _plan(self) -> RoundPlan:
        return plan_round(self.queues.snapshot(), FairShare(self.token_budget, self._tenant_weights(), self.deficits))

    def step(self) -> bool:
        """One iteration: read, plan, execute. Returns True if it did any work."""
        waited = time.monotonic()
        # Block on the stream only when nothing is runnable; otherwise just drain what has arrived.
        runnable = not self._plan().empty
        # Redis or Postgres down: wait here with nothing taken (finishing waits too, core.consumer).
        stores.until_reachable(lambda: self._gather(block=not runnable), "reading the train stream")
        plan = self._plan()
        started = time.monotonic()
        self.stats["wait_s"] += started - waited
        self._finish_exports()
        if plan.empty:
            if self.recovering:  # a replay that cannot run (given up, dropped) must not hold the state
                self._mark_recovered()
            self.backend.offload_idle(self.offload_idle_s)
            self._beacon()
            return False
        self.deficits = dict(plan.deficits)
        self._execute(plan)
        self._finish_exports()
        compute_s = time.monotonic() - started
        self.stats["busy_s"] += compute_s
        self.stats["rounds"] += 1
        self._record_round(plan, compute_s, started - waited)
        if self.recovering:
            self._mark_recovered()
        self._beacon()
        return True

    def _gather(self, *, block: bool) -> None:
        """Take in what has arrived (blocking only when `block`), and every RECLAIM_EVERY_S what dead
        trainers held; safe to repeat."""
        # While files are being written, look back soon: their saves are answered from this loop.
        block_ms = min(self.block_ms, EXPORT_POLL_MS) if self.exports else self.block_ms
        arrived = self.consumer.read(block_ms=block_ms if block else None)
        while arrived:  # a blocking read returns on the first entry: drain what came with it
            faults.crash_point("trainer.after_read")
            self._ingest(arrived)
            arrived = self.consumer.read()
        if self.shard and self.redis.exists(placement.fence_key(self.base_model, self.shard)):
            # Silent past QUILT_TRAINER_TAKEOVER_S (frozen, cut off): a peer re-placed our models and
            # restores them. Going on would run them twice; a fresh start takes what is still ours.
            log.error("shard %s was taken for dead and its models re-placed; restarting", self.shard)
            raise SystemExit(RESTART_EXIT_CODE)
        if time.monotonic() - self._reclaimed_at >= RECLAIM_EVERY_S:
            self._ingest(self.consumer.reclaim())
            self._reclaimed_at = time.monotonic()
            self._give_up_stalled()
            if self.shard:
                self._take_over_dead_shards()
                self._drain_if_asked()
                self._adopt_placed()
            else:
                self._gather_strays()

    def _tenant_weights(self) -> dict[str, float]:
        """Plan weights for fair sharing, re-read every 30 s (plans change rarely; while Postgres is
        down the last ones stand)."""
        if time.monotonic() - self._weights_at > 30:
            try:
                rows = self._db().execute("SELECT id, plan_weight FROM tenants").fetchall()
            except stores.STORE_ERRORS:
                return self._weights
            self._weights = {r["id"]: float(r["plan_weight"]) for r in rows}
            self._weights_at = time.monotonic()
        return self._weights

    def _ingest(self, deliveries: list[Delivery]) -> None:
        creating: set[str] = set()
        if self.shard:
            deliveries, creating = self._own(deliveries)
        for d in deliveries:
            item = d.item
            if item.kind is not WorkKind.CREATE_MODEL and item.model_id not in creating \
                    and not self.queues.knows(item.model_id) and not self.backend.has(item.model_id):
                self._finish(d, ServerError(
                    f"model {item.model_id!r} was lost when its trainer restarted; load your last checkpoint "
                    "into a new model"))
                continue
            added = self.queues.add(d)
            if added is Added.DUPLICATE:
                self.consumer.ack(d.stream_id)  # a redelivery of work already queued or done
            elif added is Added.LATE:
                self._finish(d, UserError(
                    f"seq_id {item.seq_id} of model {item.model_id!r} arrived after the requests behind it were "
                    f"given up waiting for it ({self.seq_gap_deadline_s:g} s); send it again with a new seq_id",
                    field="seq_id"))

    # ------------------------------------------------------------------ shards

    def _local(self, model_id: str) -> bool:
        return self.queues.knows(model_id) or self.backend.has(model_id)

    def _own(self, deliveries: list[Delivery]) -> tuple[list[Delivery], set[str]]:
        """Of the deliveries for models this shard does not hold: forward those placed on another
        shard, restore (adopt) those placed here from their snapshots. Returns what stays here,
        and the models placed here whose create has not run yet (their calls wait for it)."""
        unknown = sorted({d.item.model_id for d in deliveries if not self._local(d.item.model_id)})
        if not unknown:
            return deliveries, set()
        owners = self._owners(unknown)
        creating, kept = set(), []
        for d in deliveries:
            model_id = d.item.model_id
            shard, status = owners.get(model_id, (None, "deleted"))
            if model_id in unknown and status in placement.LIVE_STATUSES and shard != self.shard:
                queue.move(self.redis, self.consumer.stream, queue.TRAIN_GROUP, d.stream_id,
                           queue.train_stream(self.base_model, shard))
                continue
            if model_id in unknown and status == "creating":
                creating.add(model_id)
            elif model_id in unknown and status in placement.LIVE_STATUSES and not self._local(model_id):
                self._adopt(model_id)
            kept.append(d)
        return kept, creating

    def _owners(self, model_ids: list[str]) -> dict[str, tuple[str | None, str]]:
        """model -> (its shard, its status); a model gone reads (None, 'deleted'), and a live one
        not placed yet (from before shards) is placed now."""
        found = self._db_call(placement.owners, model_ids)
        out = {}
        for model_id in model_ids:
            shard, status = found.get(model_id, (None, "deleted"))
            if status in placement.LIVE_STATUSES and shard is None:
                shard = self._db_call(placement.place_unplaced, self.redis, self.base_model, model_id, self.shards)
            out[model_id] = (shard, status)
        return out

    def _adopt(self, model_id: str) -> None:
        """A model re-placed onto this shard: load its newest snapshot; the requests since it come
        moved from its old shard's stream and are replayed (answered ones for their effect only)."""
        seq_id = None
        if self.snapshots is not None:
            try:
                seq_id = self.snapshots.restore(self.backend, model_id)
            except Exception:
                log.exception("snapshot of %s could not be loaded", model_id)
                self.backend.delete(model_id)
        if seq_id is None:
            self._db_call(records.set_model_status, model_id, "lost", "its trainer shard stopped and it had no snapshot")
            return
        self.queues.resume(model_id, next_seq=seq_id + 1)
        self.recovering[model_id] = self._db_call(placement.last_answered_seq, model_id)
        log.info("adopted %s from its snapshot at seq_id %d", model_id, seq_id)

    def _adopt_placed(self) -> None:
        """Restore the models re-placed onto this shard that no call has brought yet (idle ones),
        so they read 'ready' again without waiting for their next call."""
        for model_id in self._db_call(placement.recovering_on, self.base_model, self.shard):
            if not self._local(model_id):
                self._adopt(model_id)

    def _take_over_dead_shards(self) -> None:
        """Re-place the models of peers whose liveness key lapsed (or that are past the shard count)
        and move their streams' entries (and the unsharded stream's, from before shards) to the
        models' shards, each entry once."""
        for name in queue.shard_names(self.shards) + self._db_call(placement.stray_shards, self.base_model,
                                                                   self.shards):
            stream = queue.train_stream(self.base_model, name)
            if name == self.shard or self.redis.exists(health.consumer_key(stream, name)):
                continue

            def still_dead(stream=stream, name=name) -> bool:
                return not self.redis.exists(health.consumer_key(stream, name))

            if self._db_call(placement.models_on, self.base_model, name):
                moves = self._db_call(placement.replace_dead, self.redis, self.base_model, name, self.shards,
                                      still_dead)
                if moves:
                    log.warning("shard %s stopped: its %d models re-placed: %s", name, len(moves), moves)
            if still_dead():
                self._forward(stream, lambda model_id: True)
        self._forward(queue.train_stream(self.base_model), lambda model_id: True)

    def _gather_strays(self) -> int:
        """Without shards: move into this trainer's stream the entries of shard streams whose
        trainers have stopped (QUILT_TRAINER_SHARDS lowered to 1): queued calls, and the replay
        logs since the snapshots this trainer restored its models from. A shard still running (a
        rollout's old pod) keeps its stream until its liveness key lapses. Returns how many moved."""
        moved = 0
        for name in self._db_call(placement.stray_shards, self.base_model, 1):
            stream = queue.train_stream(self.base_model, name)
            if not self.redis.exists(health.consumer_key(stream, name)):
                moved += self._forward(stream, lambda model_id: True)
        if moved:
            log.warning("%d requests moved here from the streams of trainer shards that no longer run", moved)
        return moved

    def _forward(self, source: str, which: Callable[[str], bool], page: int = 256) -> int:
        """Move the entries of `source` whose model `which` selects to the streams of the shards
        their models are placed on (entries of models gone come here, to be failed as lost);
        without shards, all of them here."""
        moved, after = 0, "-"
        while entries := self.redis.xrange(source, min=after, max="+", count=page):
            ids_of = {}
            for entry_id, fields in entries:
                try:
                    ids_of[entry_id] = WorkItem.from_fields(fields).model_id
                except MalformedWork:
                    ids_of[entry_id] = ""
            ids_of = {entry_id: model_id for entry_id, model_id in ids_of.items() if which(model_id)}
            owners = self._owners(sorted({m for m in ids_of.values() if m})) if self.shard else {}
            for entry_id, model_id in ids_of.items():
                shard, status = owners.get(model_id, (None, "deleted"))
                destination = queue.train_stream(self.base_model, shard if status in placement.LIVE_STATUSES
                                                 else self.shard)
                if destination != source and queue.move(self.redis, source, queue.TRAIN_GROUP, entry_id, destination):
                    moved += 1
            last = entries[-1][0]
            after = "(" + (last.decode() if isinstance(last, bytes) else last)
        return moved

    def _drain_if_asked(self) -> None:
        """`quilt trainers drain`: move every model placed here to the open shards, each with its
        stream entries (queued, and answered since its snapshot, which the new shard replays)."""
        if not self._db_call(placement.is_draining, self.base_model, self.shard):
            return
        mine = self._db_call(placement.models_on, self.base_model, self.shard)
        if not mine:
            return
        moves = self._db_call(placement.move_off, self.redis, self.base_model, self.shard, mine, self.shards)
        if not moves:
            log.warning("shard %s is draining but no other shard is open to take its %d models", self.shard, len(mine))
            return
        for model_id in moves:
            self.exports.wait_for(model_id)
        self._finish_exports()
        moved = self._forward(self.consumer.stream, lambda model_id: model_id in moves)
        for model_id in moves:
            self.queues.drop_model(model_id)
            self.held.pop(model_id, None)
            self.recovering.pop(model_id, None)
            self._steps_since_snapshot.pop(model_id, None)
            if self.backend.has(model_id):
                self.backend.delete(model_id)
        log.warning("draining shard %s: %d models moved (%d requests with them): %s", self.shard, len(moves), moved,
                    moves)

    def _give_up_stalled(self) -> None:
        for stalled in self.queues.give_up_stalled(self.seq_gap_deadline_s):
            seqs = [d.item.seq_id for d in stalled.given_up]
            log.warning("model %s: seq_id %d never arrived; giving up seq_ids %s", stalled.model_id,
                        stalled.missing, seqs)
            for d in stalled.given_up:
                self._finish(d, UserError(
                    f"seq_id {stalled.missing} of model {stalled.model_id!r} never arrived within "
                    f"{self.seq_gap_deadline_s:g} s, so this request (seq_id {d.item.seq_id}), which must run after "
                    "it, was not run; later calls of the model run normally", field="seq_id"))

    def _execute(self, plan: RoundPlan) -> None:
        taken = {p.request_id: self.queues.take(p) for p in (*plan.fused, *plan.barriers)}
        self._db_call(records.mark_running, list(taken))
        # A replayed request that changes no state (a forward, a save) was answered already: skip it.
        fused = [p for p in plan.fused if not self._answered_without_effect(taken[p.request_id])]
        for p in plan.fused:
            if p not in fused:
                self._finish(taken[p.request_id], {})
        if fused:
            reqs = [_pass_request(taken[p.request_id].item) for p in fused]
            outcomes = self.backend.run_pass(reqs)
            faults.crash_point("trainer.after_pass")
            for p, outcome in zip(fused, outcomes):
                d = taken[p.request_id]
                self._finish(d, outcome, metrics=self._step_metrics(d.item, outcome))
        for p in plan.barriers:
            d = taken[p.request_id]
            if d.item.kind in (WorkKind.OPTIM_STEP, WorkKind.LOAD_WEIGHTS):  # they change weights in place
                self.exports.wait_for(d.item.model_id)
                self._finish_exports()
            if self._answered_without_effect(d):
                outcome = {}
            elif d.item.kind is WorkKind.SAVE_WEIGHTS_FOR_SAMPLER:
                outcome = self._start_export(d)
                if outcome is None:
                    continue  # answered once written (_finish_exports)
            else:
                outcome = self._barrier(d.item)
            if d.item.kind is WorkKind.OPTIM_STEP:
                faults.crash_point("trainer.after_optim")
            self._finish(d, outcome)
            if not isinstance(outcome, QuiltError):
                self._after_barrier(d.item)
        self.stats["requests"] += len(taken)

    def _answered_without_effect(self, d: Delivery) -> bool:
        """A replayed request whose answer stands and whose effect is not part of the model's state."""
        return d.finished and (d.item.request_id in self._failed_before or d.item.kind in (
            WorkKind.FORWARD, WorkKind.SAVE_WEIGHTS, WorkKind.SAVE_WEIGHTS_FOR_SAMPLER, WorkKind.SAVE_WEIGHTS_EXTERNAL,
            WorkKind.REJECTED))

    def _after_barrier(self, item: WorkItem) -> None:
        """Snapshot a model whose state a barrier replaced (create, load, every N-th step), then let
        its stream entries go: the snapshot covers them."""
        if self.snapshots is None or not self.backend.has(item.model_id):
            return
        if item.kind is WorkKind.OPTIM_STEP:
            n = self._steps_since_snapshot.get(item.model_id, 0) + 1
            self._steps_since_snapshot[item.model_id] = n
            if n < self.snapshot_every_steps:
                return
        elif item.kind not in (WorkKind.CREATE_MODEL, WorkKind.LOAD_WEIGHTS):
            return
        started = time.perf_counter()
        self.snapshots.write(self.backend, item.model_id, item.seq_id)
        faults.crash_point("trainer.after_snapshot")
        self.stats["snapshot_s"] = self.stats.get("snapshot_s", 0.0) + time.perf_counter() - started
        self.stats["snapshots"] = self.stats.get("snapshots", 0) + 1
        self._steps_since_snapshot[item.model_id] = 0
        self._release(item.model_id)

    def _release(self, model_id: str) -> None:
        for stream_id in self.held.pop(model_id, []):
            self.consumer.ack(stream_id)

    def _barrier(self, item: WorkItem) -> dict | QuiltError:
        try:
            return self._barriers[item.kind](item)
        except Exception as exc:
            return _as_error(item, exc)

    # ------------------------------------------------------------------ barriers

    def _create(self, item: WorkItem) -> dict:
        work: CreateModel = item.body
        try:
            self.backend.create(item.model_id, work.lora)
            if work.load:  # create-from-checkpoint: the model's first request also loads its state
                self.backend.load(item.model_id, str(self.store.fetch(work.load.storage_path)),
                                  optimizer=work.load.optimizer)
            self._db_call(records.set_model_status, item.model_id, "ready")
        except Exception as exc:
            err = _as_error(item, exc)
            self.backend.delete(item.model_id)
            if self.snapshots is not None:
                self.snapshots.drop(item.model_id)
            self._db_call(records.set_model_status, item.model_id, "failed", err.message)
            raise err from exc
        if work.load:
            return {"type": "load_weights", "model_id": item.model_id, "path": work.load.path}
        return {"type": "create_model", "model_id": item.model_id}

    def _optim_step(self, item: WorkItem) -> dict:
        work: OptimStep = item.body
        return self.backend.optim_step(item.model_id, work.adam)

    def _load(self, item: WorkItem) -> dict:
        work: LoadWeights = item.body
        self.backend.load(item.model_id, str(self.store.fetch(work.storage_path)), optimizer=work.optimizer)
        return {"type": "load_weights", "path": work.path, "model_id": item.model_id}

    @staticmethod
    def _rejected(item: WorkItem) -> dict:
        work: Rejected = item.body  # fails in its place in the order (api.seq_gaps)
        raise UserError(work.error, field=work.field)

    def _save(self, item: WorkItem) -> dict:
        """A training checkpoint (weights and optimizer state) or an export for download (the
        adapter alone), written here, in the loop."""
        write, result = self._save_job(item)
        return self._saved(item, write(), result)

    def _start_export(self, d: Delivery) -> QuiltError | None:
        """Sampler weights (the adapter alone, tagged with the policy version they were taken at):
        checked and taken here, written by the export thread, answered by `_finish_exports`."""
        try:
            write, result = self._save_job(d.item)
        except Exception as exc:
            return _as_error(d.item, exc)

        def written() -> int:
            faults.crash_point("trainer.during_export")
            return write()

        self.exports.start(d.item.model_id, written, (d, result))
        return None

    def _finish_exports(self) -> None:
        for export in self.exports.finished():
            d, result = export.context
            try:
                outcome = self._saved(d.item, export.future.result(), result)
            except Exception as exc:
                outcome = _as_error(d.item, exc)
            self._finish(d, outcome)

    def _save_job(self, item: WorkItem) -> tuple[Callable[[], int], dict]:
        """What a save writes (LoraBackend.export) and the answer it will give."""
        work: SaveWeights = item.body
        for_sampler = item.kind is WorkKind.SAVE_WEIGHTS_FOR_SAMPLER
        kind = _checkpoint_kind(item)
        # Every save gets a new directory (core.checkpoint_files), so "exists" is a question for the records.
        if not work.overwrite and self._db_call(records.checkpoint_exists, item.model_id, kind, work.name):
            raise Conflict(f"checkpoint {work.name!r} already exists; pass overwrite=True to replace it", field="path")
        write_files = self.backend.export(item.model_id, str(self.store.local_dir(work.storage_path)),
                                          overwrite=work.overwrite, with_optimizer=item.kind is WorkKind.SAVE_WEIGHTS)

        def write() -> int:  # a save is answered only once it is in the store
            size = write_files()
            self.store.publish(work.storage_path)
            return size

        result = {"type": str(item.kind), "path": ids.tinker_path(item.model_id, kind, work.name)}
        if for_sampler:
            result["policy_version"] = self.backend.policy_version(item.model_id)
            if work.sampling_session_id:
                result["sampling_session_id"] = work.sampling_session_id
        return write, result

    def _saved(self, item: WorkItem, size: int, result: dict) -> dict:
        """Record a written checkpoint; returns the save's answer."""
        work: SaveWeights = item.body
        self._db_call(records.upsert_checkpoint, tenant_id=item.tenant_id, model_id=item.model_id,
                      kind=_checkpoint_kind(item),
                      name=work.name, storage_path=work.storage_path, size_bytes=size, ttl_s=work.ttl_s,
                      sliding=work.sliding, grace_s=get_core_settings().superseded_version_grace_s,
                      user_metadata=work.user_metadata)
        return result

    # ------------------------------------------------------------------ results

    def _step_metrics(self, item: WorkItem, outcome: dict | QuiltError) -> run_metrics.StepMetrics | None:
        """A finished forward_backward's point on its run's curves. Called right after the fused
        pass and before this round's barriers, so the model's policy version is still the one the
        pass ran at (its optimizer step count)."""
        if item.kind is not WorkKind.FORWARD_BACKWARD or isinstance(outcome, QuiltError):
            return None
        return run_metrics.StepMetrics(step=self.backend.policy_version(item.model_id),
                                       values=run_metrics.trainer_values(item.body.data, outcome["metrics"]))

    def _finish(self, d: Delivery, outcome: dict | QuiltError,
                metrics: run_metrics.StepMetrics | None = None) -> None:
        item = d.item
        if isinstance(outcome, QuiltError):
            result = queue.failure(item.request_id, outcome)
            log.info("request %s (%s %s) failed: %s", item.request_id, item.kind, item.model_id, outcome.message)
        else:
            result = queue.Outcome(item.request_id, result=outcome)
        # Kept as the replay log while the model's state is not yet in a snapshot.
        hold = self.snapshots is not None and self.backend.has(item.model_id)
        if not d.finished:
            self.consumer.finish(d, result, metrics, ack=not hold)
        elif not hold:
            self.consumer.ack(d.stream_id)
        if hold:
            self.held.setdefault(item.model_id, []).append(d.stream_id)
        else:
            self._release(item.model_id)  # a create that failed: nothing of the model is left to replay

    def _settle(self, item: WorkItem, outcome: queue.Outcome, metrics: run_metrics.StepMetrics | None) -> None:
        settle(self._db(), request_id=item.request_id, tenant_id=item.tenant_id, model_id=item.model_id,
               base_model=self.base_model, error=outcome.error, units=training_units(item.kind, item.n_tokens),
               metrics=metrics)

    def _record_round(self, plan: RoundPlan, compute_s: float, wait_s: float) -> None:
        """Per-round stats for the dashboard (a capped Redis list) and cumulative counters."""
        ps = self.backend.last_pass if plan.fused else None
        tenants = len({p.tenant_id for p in plan.fused})
        record = {
            "at": time.time(), "models": ps.models if ps else 0, "tenants": tenants,
            "requests": len(plan.fused) + len(plan.barriers), "barriers": len(plan.barriers),
            "tokens": ps.tokens if ps else 0, "padded_tokens": ps.padded_tokens if ps else 0,
            "padding_fraction": round(ps.padding_fraction, 4) if ps else 0.0,
            "micro_batches": ps.micro_batches if ps else 0,
            "compute_s": round(compute_s, 6), "wait_s": round(wait_s, 6),
        }
        if self.shard:
            record["shard"] = self.shard
        if ps:
            self._recent_tokens.append((time.monotonic(), ps.tokens))
            self.stats["tokens"] += ps.tokens
            self.stats["padded_tokens"] += ps.padded_tokens
            self.stats["models_fused"] += ps.models
            self.stats["tenants_fused"] += tenants
            self.stats["fused_rounds"] += 1  # rounds with a pass: tenants_fused / fused_rounds is the mean
        key = health.trainer_rounds_key(self.base_model)
        pipe = self.redis.pipeline()
        pipe.lpush(key, json.dumps(record))
        pipe.ltrim(key, 0, self.stats_history - 1)
        with contextlib.suppress(*stores.STORE_ERRORS):  # a dashboard record is not worth waiting for
            pipe.execute()

    def _beacon(self) -> None:
        now = time.time()
        if now - getattr(self, "_last_beacon", 0.0) < 2.0:
            return
        self._last_beacon = now
        s = self.stats
        while self._recent_tokens and self._recent_tokens[0][0] < time.monotonic() - RECENT_TOKENS_S:
            self._recent_tokens.popleft()
        self.heartbeat.update(models=len(self.backend.adapters), queued=self.queues.depth(),
                              recent_tokens=sum(n for _, n in self._recent_tokens),
                              **self.backend.residency(),
                              **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()
                                 if k != "started_at"})
        self.consumer.heartbeat()


def _as_error(item: WorkItem, exc: Exception) -> QuiltError:
    """A barrier's failure as the request's typed error (unexpected ones are logged, and are ours)."""
    if isinstance(exc, QuiltError):
        return exc
    log.exception("%s failed for %s", item.kind, item.model_id)
    return ServerError(f"{item.kind} failed: {type(exc).__name__}: {exc}")


_CHECKPOINT_KINDS = {WorkKind.SAVE_WEIGHTS: TRAINING_KIND, WorkKind.SAVE_WEIGHTS_FOR_SAMPLER: SAMPLER_KIND,
                     WorkKind.SAVE_WEIGHTS_EXTERNAL: EXTERNAL_KIND}


def _checkpoint_kind(item: WorkItem) -> str:
    return _CHECKPOINT_KINDS[item.kind]


def _pass_request(item: WorkItem) -> PassRequest:
    return PassRequest(item.request_id, item.model_id, item.body, forward_only=item.kind is WorkKind.FORWARD)


def _snapshot_store(settings) -> SnapshotStore:
    core = get_core_settings()
    root = settings.snapshot_dir or Path(core.data_dir) / "snapshots"
    return SnapshotStore(root, checkpoint_store.snapshot_store_for(core, root,
                                                                   in_checkpoint_store=settings.snapshots_in_store))


def _memory_plan(base: catalog.BaseModel, settings) -> memory_plan.MemoryPlan:
    """Check, before loading anything, that the base fits this trainer's device; exits naming the
    setting to change when it does not (core.memory_plan)."""
    from gen_pool.settings import get_gen_pool_settings

    gen = get_gen_pool_settings()
    plan = memory_plan.for_worker(base.config, device=settings.device, dtype=settings.dtype,
                                  configured_memory=settings.gpu_memory, token_budget=settings.token_budget,
                                  max_lora_rank=settings.max_rank, max_loras=gen.max_loras,
                                  gen_memory_share=gen.gpu_memory_share, max_context=base.max_context_length,
                                  shares_device=settings.shares_device)
    if plan.trainer_problems:
        raise SystemExit(f"base {base.name!r} does not fit this trainer: " + "; ".join(plan.trainer_problems))
    log.info("memory plan for %s: %s", base.name, ", ".join(f"{k.strip()}={v}" for k, v in plan.rows()[:8]))
    return plan


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    settings = get_trainer_settings()
    if settings.keep_freed_memory:
        heap.keep_freed_memory()
    db_url = db.resolve_url()
    base = catalog.worker_base(db_url, settings.base_model)
    plan = _memory_plan(base, settings)
    token_budget = settings.token_budget or plan.token_budget
    dtype = getattr(torch, memory_plan.resolve_dtype(settings.dtype, settings.device))
    shards = get_core_settings().trainer_shards
    # A shard is named by its worker's ordinal: `shard-i` under quilt up, pod quilt-trainer-i on a cluster.
    shard = queue.shard_of(settings.consumer_name, shards) if shards > 1 else None
    if shard and get_core_settings().checkpoint_store == "s3" and not settings.snapshots_in_store:
        log.warning("%d trainer shards with snapshots on this machine's disk only: a shard on another machine "
                    "cannot restore this one's models; set QUILT_TRAINER_SNAPSHOTS_IN_STORE=true", shards)
    worker = TrainerWorker(
        base_model=base.name, backend=LoraBackend(
            base.path, device=settings.device, max_tokens_per_pass=token_budget, offload_device=settings.offload_device,
            dtype=dtype, max_resident=settings.max_resident_adapters or plan.resident_adapters),
        redis=redis_client.sync_client(), db_url=db_url, consumer=settings.consumer_name,
        block_ms=settings.read_block_ms, result_ttl_s=get_api_settings().future_ttl_seconds,
        token_budget=token_budget, offload_idle_s=settings.offload_idle_s, stats_history=settings.stats_history,
        seq_gap_deadline_s=settings.seq_gap_deadline_s,
        snapshots=_snapshot_store(settings) if settings.snapshots else None,
        snapshot_every_steps=settings.snapshot_every_steps, shard=shard, shards=shards,
        takeover_s=settings.takeover_s,
    )

    def _stop(signum, frame):
        worker.stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    worker.run_forever()
    log.info("trainer stopped")


if __name__ == "__main__":
    main()
