"""The trainer's loop: reads its base model's stream, plans rounds, runs them, records results.

The loop only moves data: stream (core.consumer) -> ModelQueues -> plan_round (pure) -> TrainerBackend
(the fused pass, batcher.engine) and the barrier table (batcher.barriers) -> results to Redis (futures) and
Postgres (request rows, checkpoints), then acknowledges the stream entries. Its collaborators hold
the rules: the replay log (batcher.replay: which entries are kept until a snapshot covers them),
shard membership (batcher.shards: which models are this shard's), round statistics
(batcher.round_stats). The process entry point is batcher.main.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from batcher.barriers import Barriers
from batcher.engine.protocol import Outcome, PassRequest, TrainerBackend
from batcher.policy import FairShare, RoundPlan, plan_round
from batcher.queues import Added, ModelQueues, late_error
from batcher.replay import ReplayLog
from batcher.round_stats import RoundStats
from batcher.shards import ShardMembership
from batcher.snapshots import SnapshotStore
from billing.ledger import settle
from billing.pricing import training_units
from checkpoints import storage
from core import db, faults, health, queue, records, run_metrics, stores
from core.consumer import Delivery, StreamConsumer
from core.errors import QuiltError, ServerError
from core.settings import TrainerSettings
from core.work import PassWork, WorkItem, WorkKind
from scaleout import placement

log = logging.getLogger("quilt.trainer")

T = TypeVar("T")


# A trainer's round can take seconds, and its liveness key is refreshed between rounds only: it is
# kept long enough that a busy trainer is never taken for a dead one. A consumer without a key has
# its entries taken once they have been idle RECLAIM_IDLE_MS, checked every RECLAIM_EVERY_S.
LIVENESS_TTL_S = 60
RECLAIM_IDLE_MS = 15_000
RECLAIM_EVERY_S = 5.0
EXPORT_POLL_MS = 5
RESTART_EXIT_CODE = 75  # a fenced shard exits so its supervisor starts it afresh
BEACON_EVERY_S = 2.0


class TrainerWorker:
    def __init__(self, settings: TrainerSettings, *, base_model: str, backend: TrainerBackend, redis: Any, db_url: str,
                 result_ttl_s: int, token_budget: int | None = None, snapshots: SnapshotStore | None = None,
                 shard: str | None = None, shards: int = 1):
        self.settings = settings
        self.base_model = base_model
        self.shard = shard  # with QUILT_TRAINER_SHARDS above 1: this worker holds the models placed on it
        self.backend = backend
        self.db_url = db_url
        self.token_budget = token_budget
        # Durable state (batcher.snapshots): without a store, models live in memory only (lost on restart).
        self.snapshots = snapshots
        self.replay = ReplayLog(settings.snapshot_every_steps)
        stream = queue.train_stream(base_model, shard)
        self.consumer = StreamConsumer(
            redis, stream=stream, group=queue.TRAIN_GROUP, consumer=shard or settings.consumer_name,
            settle=self._settle, result_ttl_s=result_ttl_s, liveness_ttl_s=settings.takeover_s if shard else LIVENESS_TTL_S,
            reclaim_idle_ms=RECLAIM_IDLE_MS, what="trained", finished=self._finished_ids)
        self.membership = ShardMembership(redis=redis, base_model=base_model, shard=shard, shards=shards,
                                          stream=stream, db_call=self._db_call)
        self.queues = ModelQueues()
        self.barriers = Barriers(backend=backend, store=storage.get_store(), snapshots=snapshots,
                                 db_call=self._db_call)
        self.stats = RoundStats(redis=redis, base_model=base_model, shard=shard, history=settings.stats_history)
        # A shard's liveness key is kept by its heartbeat thread: a long round never looks like death.
        self.heartbeat = health.Heartbeat(
            redis, health.trainer_key(base_model, shard),
            also=((health.consumer_key(stream, shard), settings.takeover_s),) if shard else ())
        self.deficits: dict[str, float] = {}  # fair-share state carried between rounds
        self._weights: dict[str, float] = {}
        self._weights_at = 0.0
        self._reclaimed_at = time.monotonic()
        self._beacon_at = 0.0
        self._conn: db.Conn | None = None
        self.stopping = False

    # ------------------------------------------------------------------ setup

    def _db(self) -> db.Conn:
        self._conn = db.live_connection(self._conn, self.db_url,
                                        db.session_name("trainer", self.shard, self.base_model) if self.shard else "")
        return self._conn

    def _db_call(self, record: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`record(connection, *args, **kwargs)` (an idempotent read or write of core.records) on this
        worker's connection, waiting out a Postgres restart (core.stores) instead of failing the
        round it is part of."""
        return stores.until_reachable(lambda: record(self._db(), *args, **kwargs), record.__name__)

    def prepare(self) -> None:
        self.consumer.ensure_group()
        self.consumer.heartbeat()
        self.membership.clear_fence()
        # Without snapshots nothing can come back: nothing is claimed, and every live model is lost.
        restored = [m for m in placement.claim_own(self._db(), self.base_model, self.shard) if self._restore(m)] \
            if self.snapshots is not None else []
        lost = records.mark_models_lost(self._db(), self.base_model, keep=restored, shard=self.shard)
        if restored:
            log.info("%d models restored from their snapshots", len(restored))
        if lost:
            log.warning("%d models of a previous trainer process are lost (no snapshot)", lost)
        # Our own unacknowledged entries from before a crash come back first: queued work, and the
        # replay log of every restored model since its snapshot; without shards, then those the
        # shards of a larger QUILT_TRAINER_SHARDS left in their streams.
        self._ingest(self.consumer.read(own_pending=True))
        if not self.shard and self.membership.gather_strays():
            while arrived := self.consumer.read():
                self._ingest(arrived)
        for model_id in restored:
            self.replay.recover(model_id, self.queues.last_seq(model_id, finished=True))
        self._mark_recovered()

    def _restore(self, model_id: str) -> bool:
        """Load `model_id`'s newest snapshot; its sequence goes on after it. False: none to load."""
        seq_id = self.snapshots.restore(self.backend, model_id) if self.snapshots is not None else None
        if seq_id is None:
            return False
        self.queues.resume(model_id, next_seq=seq_id + 1)
        return True

    def _adopt(self, model_id: str) -> None:
        """A model re-placed onto this shard: load its newest snapshot; the requests since it come
        moved from its old shard's stream and are replayed (answered ones for their effect only)."""
        if not self._restore(model_id):
            self._db_call(records.set_model_status, model_id, "lost", "its trainer shard stopped and it had no snapshot")
            return
        self.replay.recover(model_id, self._db_call(placement.last_answered_seq, model_id))
        log.info("adopted %s from its snapshot at seq_id %d", model_id, self.queues.next_seq[model_id] - 1)

    def _mark_recovered(self) -> None:
        """Restored models whose replay log has run are 'ready' again."""
        for model_id in self.replay.recovered(self.queues.next_seq):
            self._db_call(records.set_model_status, model_id, "ready")

    def _finished_ids(self, request_ids: list[str]) -> Mapping[str, str]:
        return self.replay.note_finished(records.finished_requests(self._db(), request_ids))

    def _local(self, model_id: str) -> bool:
        return self.queues.knows(model_id) or self.backend.has(model_id)

    # ------------------------------------------------------------------ loop

    def run_forever(self) -> None:
        self.prepare()
        self.heartbeat.start()
        log.info("trainer for %s ready", self.base_model)
        try:
            while not self.stopping:
                self.step()
            self.barriers.exports.wait_for()
            self._finish_exports()
        finally:
            self.barriers.exports.close()
            self.heartbeat.stop()

    def step(self) -> bool:
        """One iteration: read, plan, execute. Returns True if it did any work."""
        waited = time.monotonic()
        # Block on the stream only when nothing is runnable; otherwise just drain what has arrived.
        # Redis or Postgres down: wait here with nothing taken (finishing waits too, core.consumer).
        block = not self.queues.runnable()
        stores.until_reachable(lambda: self._gather(block=block), "reading the train stream")
        plan = plan_round(self.queues.snapshot(), FairShare(self.token_budget, self._tenant_weights(), self.deficits))
        started = time.monotonic()
        self.stats.add("wait_s", started - waited)
        self._finish_exports()
        if plan.empty:
            self.backend.offload_idle(self.settings.offload_idle_s)
        else:
            self.deficits = dict(plan.deficits)
            self._execute(plan)
            self._finish_exports()
            self.stats.record(plan, self.backend.last_pass if plan.fused else None, time.monotonic() - started,
                              started - waited)
        if self.replay.recovering:  # also when a replay cannot run (given up, dropped): it must not hold the state
            self._mark_recovered()
        self._beacon()
        return not plan.empty

    def _gather(self, *, block: bool) -> None:
        """Take in what has arrived (blocking only when `block`), and every RECLAIM_EVERY_S what dead
        trainers held; safe to repeat."""
        # While files are being written, look back soon: their saves are answered from this loop.
        block_ms = min(self.settings.read_block_ms, EXPORT_POLL_MS) if self.barriers.exports \
            else self.settings.read_block_ms
        arrived = self.consumer.read(block_ms=block_ms if block else None)
        while arrived:  # a blocking read returns on the first entry: drain what came with it
            faults.crash_point("trainer.after_read")
            self._ingest(arrived)
            arrived = self.consumer.read()
        if self.membership.fenced():
            # Silent past QUILT_TRAINER_TAKEOVER_S (frozen, cut off): a peer re-placed our models and
            # restores them. Going on would run them twice; a fresh start takes what is still ours.
            log.error("shard %s was taken for dead and its models re-placed; restarting", self.shard)
            raise SystemExit(RESTART_EXIT_CODE)
        if time.monotonic() - self._reclaimed_at < RECLAIM_EVERY_S:
            return
        self._ingest(self.consumer.reclaim())
        self._reclaimed_at = time.monotonic()
        self._give_up_stalled()
        if not self.shard:
            self.membership.gather_strays()
            return
        self.membership.take_over_dead()
        self._drain(self.membership.to_drain())
        for model_id in self.membership.placed_here(self._local):
            self._adopt(model_id)

    def _tenant_weights(self) -> dict[str, float]:
        """Plan weights for fair sharing, re-read every 30 s (plans change rarely; while Postgres is
        down the last ones stand)."""
        if time.monotonic() - self._weights_at > 30:
            try:
                self._weights = records.plan_weights(self._db())
            except stores.STORE_ERRORS:
                return self._weights
            self._weights_at = time.monotonic()
        return self._weights

    def _ingest(self, deliveries: list[Delivery]) -> None:
        mine = self.membership.sort(deliveries, self._local)
        for model_id in mine.adopt:
            self._adopt(model_id)
        for d in mine.kept:
            item = d.item
            if item.kind is not WorkKind.CREATE_MODEL and item.model_id not in mine.creating \
                    and not self._local(item.model_id):
                self._finish(d, ServerError(
                    f"model {item.model_id!r} was lost when its trainer restarted; load your last checkpoint "
                    "into a new model"))
                continue
            added = self.queues.add(d)
            if added is Added.DUPLICATE:
                self.consumer.ack(d.stream_id)  # a redelivery of work already queued or done
            elif added is Added.LATE:
                self._finish(d, late_error(item, self.settings.seq_gap_deadline_s))

    def _drain(self, moves: list[str]) -> None:
        """Hand the models `moves` (placed on other shards now) on, each with its stream entries
        (queued, and answered since its snapshot, which the new shard replays)."""
        if not moves:
            return
        for model_id in moves:
            self.barriers.exports.wait_for(model_id)
        self._finish_exports()
        moved = self.membership.forward(self.consumer.stream, lambda model_id: model_id in moves)
        for model_id in moves:
            self.queues.drop_model(model_id)
            self.replay.forget(model_id)
            if self.backend.has(model_id):
                self.backend.delete(model_id)
        log.warning("draining shard %s: %d models moved (%d requests with them): %s", self.shard, len(moves), moved,
                    moves)

    def _give_up_stalled(self) -> None:
        for stalled in self.queues.give_up_stalled(self.settings.seq_gap_deadline_s):
            seqs = [d.item.seq_id for d in stalled.given_up]
            log.warning("model %s: seq_id %d never arrived; giving up seq_ids %s", stalled.model_id,
                        stalled.missing, seqs)
            for d in stalled.given_up:
                self._finish(d, stalled.error(d, self.settings.seq_gap_deadline_s))

    def _execute(self, plan: RoundPlan) -> None:
        taken = {p.request_id: self.queues.take(p) for p in (*plan.fused, *plan.barriers)}
        self._db_call(records.mark_running, list(taken))
        # The wait since the API appended the entry (its id is Redis's clock); a redelivery of an
        # answered request is a replay, not a wait anyone had.
        now = time.time()
        self.stats.started([now - queue.appended_at(d.stream_id) for d in taken.values() if not d.finished])
        fused = []
        for p in plan.fused:
            d = taken[p.request_id]
            if self.replay.without_effect(d):  # a replayed forward was answered already: skip it
                self._finish(d, {})
            else:
                fused.append(d)
        if fused:
            outcomes = self.backend.run_pass([PassRequest(d.item.request_id, d.item.model_id, d.item.body_as(PassWork),
                                                          forward_only=d.item.kind is WorkKind.FORWARD)
                                              for d in fused])
            faults.crash_point("trainer.after_pass")
            for d, outcome in zip(fused, outcomes):  # a forward_backward's point on its run's curves, at
                # the policy version the pass ran at (before this round's barriers step the model)
                metrics = None
                if d.item.kind is WorkKind.FORWARD_BACKWARD and not isinstance(outcome, QuiltError):
                    metrics = run_metrics.StepMetrics(self.backend.policy_version(d.item.model_id),
                                                      run_metrics.trainer_values(d.item.body_as(PassWork).data,
                                                                                 outcome["metrics"]))
                self._finish(d, outcome, metrics=metrics)
        barriers = [taken[p.request_id] for p in plan.barriers]
        for d, outcome in self.barriers.begin_round([d.item for d in barriers if not self.replay.without_effect(d)]):
            self._finish(d, outcome)
        for d in barriers:
            ran = {} if self.replay.without_effect(d) else self.barriers.run(d.item, d)
            if ran is None:
                continue  # answered once written (_finish_exports)
            if d.item.kind is WorkKind.OPTIM_STEP:
                faults.crash_point("trainer.after_optim")
            self._finish(d, ran)
            if not isinstance(ran, QuiltError):
                self._after_barrier(d.item)
        self.stats.add("requests", len(taken))

    def _after_barrier(self, item: WorkItem) -> None:
        """Snapshot a model whose state a barrier replaced (create, load, every N-th step), then let
        its stream entries go: the snapshot covers them."""
        if self.snapshots is None or not self.backend.has(item.model_id) or not self.replay.snapshot_due(item):
            return
        started = time.perf_counter()
        self.snapshots.write(self.backend, item.model_id, item.seq_id)
        faults.crash_point("trainer.after_snapshot")
        self.stats.add("snapshot_s", time.perf_counter() - started)
        self.stats.add("snapshots", 1)
        for stream_id in self.replay.snapshotted(item.model_id):
            self.consumer.ack(stream_id)

    # ------------------------------------------------------------------ results

    def _finish_exports(self) -> None:
        for d, outcome in self.barriers.finished_exports():
            self._finish(d, outcome)

    def _finish(self, d: Delivery, outcome: Outcome, metrics: run_metrics.StepMetrics | None = None) -> None:
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
            self.replay.hold(item.model_id, d.stream_id)
        else:  # a create that failed: nothing of the model is left to replay
            for stream_id in self.replay.release(item.model_id):
                self.consumer.ack(stream_id)

    def _settle(self, item: WorkItem, outcome: queue.Outcome,
                metrics: run_metrics.StepMetrics | None) -> records.Settled | None:
        return settle(self._db(), request_id=item.request_id, tenant_id=item.tenant_id, model_id=item.model_id,
               base_model=self.base_model, error=outcome.error, units=training_units(item.kind, item.n_tokens),
               metrics=metrics)

    def _beacon(self) -> None:
        if time.time() - self._beacon_at < BEACON_EVERY_S:
            return
        self._beacon_at = time.time()
        residency: dict[str, Any] = self.backend.residency()
        self.heartbeat.update(models=sum(residency.values()), queued=self.queues.depth(), **residency,
                              **self.stats.beacon_fields())
        self.consumer.heartbeat()
