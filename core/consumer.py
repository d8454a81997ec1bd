"""A worker's side of a work stream, written once for both workers.

    ensure_group      create the consumer group (and the stream) if missing
    read              new entries (`>`), or this consumer's own unacknowledged ones after a restart
    reclaim           take over the pending entries of consumers that died (no liveness key)
    finish            write the durable record, publish the future's result, acknowledge
    heartbeat         refresh this consumer's liveness key (its pending entries stay its own)

Delivery rules, the same for the trainer and the generation pool:
  * an entry delivered more than `max_deliveries` times (each crash and restart, or take-over,
    delivers it again) is failed instead of run: it is what keeps killing the worker;
  * an entry whose fields were deleted while pending, or that is not a readable work item, is
    acknowledged (failed first when its request id can be read), never retried forever;
  * a live consumer's entries are never taken, however long they run; a dead one's are taken once
    they have been idle `reclaim_idle_ms`.
Finishing order: the durable record first (request row and ledger, through the `settle` callable
the worker passes, once per request), then the future in Redis, then the ack; while a store is
down, each waits for it (core.stores). The row comes first because the future is what a client
acts on: one that retries the moment it reads a failure must find its request no longer counted
against its quota.
A crash between any two leaves the entry pending, so it is delivered again: `settle` keeps the
first record and says so, and the future is then published only if it is not stored yet (with the
row's failure, when the row failed), so a client is answered once. A worker that keeps entries as
a replay log marks them finished from their rows (`Finished`); one whose row was settled but whose
future was never published (`core.queue.unanswered`) is delivered as not finished, to be run
again and answered.

`StreamConsumer` is the synchronous face (the trainer's loop); `AsyncStreamConsumer` runs the same
methods off the event loop for the generation worker: blocking reads on one thread, everything
else on another, so results and acknowledgements never queue behind a read.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from core import faults, health, queue, records, stores
from core.errors import ServerError
from core.work import MalformedWork, Rejected, WorkItem, WorkKind

log = logging.getLogger("quilt.consumer")

MAX_DELIVERIES = 3
REPLAY_DELIVERIES_FACTOR = 3


_P = ParamSpec("_P")
_T = TypeVar("_T")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True)
class Delivery:
    """One work item as this consumer received it. `finished`: a redelivery of a request that
    already has its outcome (a worker that keeps entries as a replay log reads them back)."""

    stream_id: str
    item: WorkItem
    finished: bool = False


# Writes a finished request's durable record: (item, outcome, the worker's usage details); returns
# how the row stands (`billing.ledger.settle`), None when that is not known (no row).
Settle = Callable[[WorkItem, queue.Outcome, Any], records.Settled | None]
# Which of these request ids already have their outcome, read back from the database: id -> 'done'
# or 'failed'.
Finished = Callable[[list[str]], Mapping[str, str]]


def orphaned_consumers(pending: dict[str, int], alive: set[str], me: str) -> list[str]:
    """Consumers whose pending entries another worker should take over: they hold some, and have
    no liveness key (they died and did not come back under the same name)."""
    return sorted(c for c, n in pending.items() if n > 0 and c != me and c not in alive)


def over_delivered(counts: dict[str, int], stream_id: str, max_deliveries: int) -> bool:
    """Whether an entry was delivered too often to be run again (counts are from before this read)."""
    return counts.get(stream_id, 0) > max_deliveries


class StreamConsumer:
    def __init__(self, redis: Any, *, stream: str, group: str, consumer: str, settle: Settle, result_ttl_s: int,
                 liveness_ttl_s: int, what: str, max_deliveries: int = MAX_DELIVERIES, batch: int = 512,
                 reclaim_idle_ms: int | None = None, finished: Finished | None = None) -> None:
        self.redis = redis
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.settle = settle
        self.result_ttl_s = result_ttl_s
        self.liveness_ttl_s = liveness_ttl_s
        self.what = what  # "trained", "sampled": for the message of an over-delivered request
        self.max_deliveries = max_deliveries
        self.batch = batch
        self.reclaim_idle_ms = reclaim_idle_ms if reclaim_idle_ms is not None else liveness_ttl_s * 1000
        self.finished = finished

    # ------------------------------------------------------------------ intake

    def ensure_group(self) -> None:
        try:
            self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except Exception as exc:  # BUSYGROUP: it exists already
            if "BUSYGROUP" not in str(exc):
                raise

    def read(self, *, block_ms: int | None = None, own_pending: bool = False) -> list[Delivery]:
        """New entries, waiting up to `block_ms` for the first (None: don't wait); or, with
        `own_pending`, this consumer's unacknowledged entries from before a restart."""
        if not own_pending:
            reply = self.redis.xreadgroup(self.group, self.consumer, {self.stream: ">"}, count=self.batch,
                                          block=block_ms)
            return self._accept(reply[0][1] if reply else [], {})
        counts = self._delivery_counts()
        out: list[Delivery] = []
        after = "0"
        while True:  # every pending entry, page by page: a replay log can be longer than a batch
            reply = self.redis.xreadgroup(self.group, self.consumer, {self.stream: after}, count=self.batch)
            entries = reply[0][1] if reply else []
            if not entries:
                return out
            out += self._accept(entries, counts)
            after = _text(entries[-1][0])

    def reclaim(self) -> list[Delivery]:
        """Take over the pending entries of consumers that died and did not come back (another
        replica, or this one under an old name)."""
        summary = self.redis.xpending(self.stream, self.group)
        pending = {_text(c["name"]): int(c["pending"]) for c in summary.get("consumers") or []}
        alive = {c for c in pending if self.redis.exists(health.consumer_key(self.stream, c))}
        taken: list[Delivery] = []
        for consumer in orphaned_consumers(pending, alive, self.consumer):
            stale = self.redis.xpending_range(self.stream, self.group, min="-", max="+", count=1000,
                                              consumername=consumer, idle=self.reclaim_idle_ms)
            if not stale:
                continue
            counts = {_text(p["message_id"]): int(p["times_delivered"]) for p in stale}
            # min_idle_time again: if two workers race, the second finds the entries freshly claimed.
            claimed = self.redis.xclaim(self.stream, self.group, self.consumer, min_idle_time=self.reclaim_idle_ms,
                                        message_ids=[p["message_id"] for p in stale])
            if claimed:
                log.warning("taking over %d requests of %s on %s, which stopped", len(claimed), consumer, self.stream)
                taken += self._accept(claimed, counts)
        return taken

    def _delivery_counts(self) -> dict[str, int]:
        pending = self.redis.xpending_range(self.stream, self.group, min="-", max="+", count=10_000,
                                            consumername=self.consumer)
        return {_text(p["message_id"]): int(p["times_delivered"]) for p in pending}

    def _accept(self, entries: list[Any], counts: dict[str, int]) -> list[Delivery]:
        items: list[tuple[str, WorkItem]] = []
        for stream_id, fields in entries:
            sid = _text(stream_id)
            if not fields:  # deleted while pending
                self.ack(sid)
                continue
            try:
                items.append((sid, WorkItem.from_fields(fields)))
            except MalformedWork as exc:
                self._drop_malformed(sid, fields, exc)
                continue
            moved = fields.get(queue.MOVED_FIELD.encode(), fields.get(queue.MOVED_FIELD))
            if moved:  # each move off a dead replica's stream was a delivery there (gen_pool.router)
                counts = {**counts, sid: counts.get(sid, 0) + int(moved)}
        done = self.finished([i.request_id for _, i in items]) if counts and self.finished and items else {}
        # Settled, then the worker died before publishing: run again, so the client gets its answer
        # (settle keeps the first record). A failed one stays finished: its row holds the failure,
        # which retrieve_future answers from, and running it again could change the model.
        lost = queue.unanswered(self.redis, [r for r, status in done.items() if status == "done"])
        out = []
        for sid, item in items:
            delivery = Delivery(sid, item, finished=item.request_id in done and item.request_id not in lost)
            if delivery.finished:
                # Kept as a replay log, its answer given: re-run for its effect, with a looser cap; past
                # it the entry is dropped from the log (its answer stands) rather than crash forever.
                if over_delivered(counts, sid, REPLAY_DELIVERIES_FACTOR * self.max_deliveries):
                    log.error("dropping %s (request %s) from the replay log of %s: its worker died each of the "
                              "last %d times it was replayed", sid, item.request_id, self.stream,
                              REPLAY_DELIVERIES_FACTOR * self.max_deliveries)
                    self.ack(sid)
                    continue
            elif over_delivered(counts, sid, self.max_deliveries):
                self.finish(delivery, queue.failure(item.request_id, ServerError(
                    f"request {item.request_id} was being {self.what} each of the last {self.max_deliveries} times "
                    "its worker died; it is failed so the others can go on")))
                continue
            out.append(delivery)
        return out

    def _drop_malformed(self, stream_id: str, fields: dict[Any, Any], exc: Exception) -> None:
        """Acknowledge an unreadable entry; first fail its request when the entry still names it
        (so its row stops counting as in flight)."""
        log.error("dropping unreadable entry %s on %s: %s", stream_id, self.stream, exc)
        try:
            value: Any = fields.get(WorkItem.FIELD.encode()) or fields.get(WorkItem.FIELD)
            raw = json.loads(value)
            item = WorkItem(str(raw["request_id"]), str(raw["tenant_id"]), str(raw.get("model_id") or ""),
                            int(raw.get("seq_id") or 0), WorkKind.REJECTED, 0, Rejected("malformed request"))
        except (TypeError, ValueError, KeyError):
            self.ack(stream_id)
            return
        self.finish(Delivery(stream_id, item), queue.failure(item.request_id, ServerError(f"malformed request: {exc}")))
        if raw.get("kind") == WorkKind.SAMPLE and item.model_id:  # its session's poller waits for it too
            queue.note_session_done(self.redis, item.model_id, item.seq_id, item.request_id, self.result_ttl_s,
                                    size=None)

    # ------------------------------------------------------------------ results

    def finish(self, delivery: Delivery, outcome: queue.Outcome, usage: Any = None, *, ack: bool = True) -> None:
        """Settle the outcome, publish it, acknowledge the entry (unless the worker keeps it). While
        Redis or Postgres is down this waits for it (core.stores): each step is safe to repeat."""
        item = delivery.item
        what = f"finishing {item.request_id}"
        # Encoded before settling: a result JSON cannot carry is recorded as the failure it is stored as.
        stored = queue.storable(outcome)
        settled = stores.until_reachable(lambda: self.settle(item, stored, usage if stored.ok else None), what)
        faults.crash_point(f"{self.group}.after_settle")
        stores.until_reachable(lambda: self._answer(item, stored, settled), what)
        faults.crash_point(f"{self.group}.after_publish")
        if ack:
            self.ack(delivery.stream_id)

    def _answer(self, item: WorkItem, outcome: queue.Outcome, settled: records.Settled | None) -> None:
        if settled is not None and not settled.first:
            # A redelivery: the first answer stands if it got out, and the row's failure is the answer if
            # the row failed (a re-run must not tell the client otherwise).
            if self.redis.exists(queue.future_key(item.request_id)):
                return
            if settled.error is not None:
                outcome = queue.Outcome(item.request_id, error=settled.error)
        queue.publish(self.redis, outcome, self.result_ttl_s, item)

    def ack(self, stream_id: str) -> None:
        def once() -> None:
            pipe = self.redis.pipeline()
            pipe.xack(self.stream, self.group, stream_id)
            pipe.xdel(self.stream, stream_id)
            pipe.execute()

        stores.until_reachable(once, f"acknowledging {stream_id}")

    def heartbeat(self) -> None:
        """Refresh this consumer's liveness key. Best effort: while Redis is down there is nothing to
        refresh, and the next call after it is back does it."""
        with contextlib.suppress(*stores.STORE_ERRORS):
            self.redis.set(health.consumer_key(self.stream, self.consumer), b"1", ex=self.liveness_ttl_s)


class AsyncStreamConsumer:
    """The same consumer for an asyncio worker: each call runs on a worker thread."""

    def __init__(self, sync: StreamConsumer) -> None:
        self.sync = sync
        self._reads = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="stream-read")
        self._writes = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="stream-write")

    async def _on(self, pool: concurrent.futures.Executor, fn: Callable[_P, _T], *args: _P.args,
                  **kw: _P.kwargs) -> _T:
        return await asyncio.get_running_loop().run_in_executor(pool, lambda: fn(*args, **kw))

    async def ensure_group(self) -> None:
        await self._on(self._writes, self.sync.ensure_group)

    async def read(self, *, block_ms: int | None = None, own_pending: bool = False) -> list[Delivery]:
        return await self._on(self._reads, self.sync.read, block_ms=block_ms, own_pending=own_pending)

    async def reclaim(self) -> list[Delivery]:
        return await self._on(self._writes, self.sync.reclaim)

    async def finish(self, delivery: Delivery, outcome: queue.Outcome, usage: Any = None) -> None:
        await self._on(self._writes, self.sync.finish, delivery, outcome, usage)

    async def heartbeat(self) -> None:
        await self._on(self._writes, self.sync.heartbeat)

    def shutdown(self) -> None:
        self._reads.shutdown(wait=False, cancel_futures=True)
        self._writes.shutdown(wait=False, cancel_futures=True)
