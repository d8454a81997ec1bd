"""The generation worker: reads its base model's sample stream into the scheduler, and publishes
each group's result when its last sequence finishes.

The loop only moves data: Redis -> `Group`s -> Scheduler (plan_admission, pure; engine tasks) ->
results to Redis (futures) and Postgres (request rows, usage), then the stream entry is
acknowledged. Everything runs on one asyncio loop; Postgres writes go through one thread so they
never stall it. Cancellations arrive by pub/sub (any worker may hold the request).

Run: `python -m gen_pool.worker` (the embedded launcher does this, one per sampleable base model).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import signal
import time
from pathlib import Path

import psycopg

from billing.ledger import settle
from billing.pricing import Units
from core import catalog, db, health, queue, redis_client
from core.errors import QuiltError, ServerError
from core.settings import get_api_settings, get_core_settings
from gen_pool import wire
from gen_pool.adapters import AdapterRef
from gen_pool.engine import GenEngine
from gen_pool.params import SamplingSpec
from gen_pool.scheduler import Group, Scheduler
from gen_pool.settings import GenPoolSettings, get_gen_pool_settings


log = logging.getLogger("quilt.gen")

MAX_DELIVERIES = 3  # a request read this often by restarted workers is failed instead of run again
# A worker whose liveness key is gone (no beacon for GEN_TTL_S) is dead: its pending entries are
# taken over once they have been idle that long too, checked this often.
RECLAIM_IDLE_MS = health.GEN_TTL_S * 1000
RECLAIM_EVERY_S = 5.0


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


def group_from_item(item: queue.WorkItem, stream_id: str, base_model: str) -> Group:
    b = item.body
    adapter = AdapterRef.from_json(b.get("adapter"))
    return Group(request_id=item.request_id, tenant_id=item.tenant_id, prompt=tuple(b["prompt"]),
                 spec=SamplingSpec.from_json(b["spec"]), n=int(b["n"]), adapter=adapter,
                 model_id=adapter.model_id if adapter else base_model,
                 prompt_logprobs=bool(b.get("prompt_logprobs")),
                 prompt_logprobs_last_n=b.get("prompt_logprobs_last_n"),
                 arrival=float(b.get("submitted_at") or time.time()), deadline=b.get("deadline_at"),
                 context=(item, stream_id))


class GenWorker:
    def __init__(self, *, base_model: str, engine: GenEngine, redis, db_url: str, settings: GenPoolSettings,
                 result_ttl_s: int):
        self.base_model = base_model
        self.engine = engine
        self.redis = redis
        self.db_url = db_url
        self.settings = settings
        self.result_ttl_s = result_ttl_s
        self.stream = queue.sample_stream(base_model)
        self.scheduler = Scheduler(engine, target=settings.concurrency_target, default_cap=settings.tenant_cap,
                                   share_after_s=settings.share_after_s, on_finish=self._on_finish)
        self.stopping = False
        self._db_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gen-db")
        self._conn: psycopg.Connection | None = None

    # ------------------------------------------------------------------ loop

    async def run(self) -> None:
        try:
            await self.redis.xgroup_create(self.stream, queue.SAMPLE_GROUP, id="0", mkstream=True)
        except Exception as exc:  # BUSYGROUP: it exists already
            if "BUSYGROUP" not in str(exc):
                raise
        # Our own unacknowledged entries from before a crash come back first, unless they were
        # delivered so often that they are what keeps killing the engine.
        await self._ingest(await self._read("0", block_ms=None), check_redelivery=True)
        tasks = [asyncio.create_task(self._reader(), name="reader"),
                 asyncio.create_task(self._cancellations(), name="cancels"),
                 asyncio.create_task(self._reclaimer(), name="reclaim")]
        log.info("generation worker for %s ready", self.base_model)
        try:
            while not self.stopping:
                self.scheduler.step()
                await self._beacon()
                if self.engine.dead:
                    raise ServerError("the engine died; exiting so the launcher restarts the worker")
                await self.scheduler.wait(2.0)  # at least every 2 s, to refresh the health beacon
        finally:
            for t in tasks:
                t.cancel()
            self.scheduler.shutdown()

    def stop(self) -> None:
        self.stopping = True
        self.scheduler.wake()

    # ------------------------------------------------------------------ intake

    async def _read(self, last_id: str, *, block_ms: int | None) -> list:
        reply = await self.redis.xreadgroup(queue.SAMPLE_GROUP, self.settings.consumer_name, {self.stream: last_id},
                                            count=256, block=block_ms)
        return reply[0][1] if reply else []

    async def _reader(self) -> None:
        while not self.stopping:
            try:
                entries = await self._read(">", block_ms=self.settings.read_block_ms)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reading %s failed; retrying", self.stream)
                await asyncio.sleep(1.0)
                continue
            if entries:
                await self._ingest(entries)
                self.scheduler.wake()

    async def _ingest(self, entries: list, *, check_redelivery: bool = False) -> None:
        delivered = await self._delivery_counts() if check_redelivery else {}
        for stream_id, fields in entries:
            sid = _text(stream_id)
            if not fields:  # deleted while pending
                await self._ack(sid)
                continue
            item = queue.WorkItem.from_fields(fields)
            if delivered.get(sid, 0) > MAX_DELIVERIES:
                err = ServerError(f"request {item.request_id} was being sampled each of the last {MAX_DELIVERIES} "
                                  "times the generation worker died; it is failed so the pool can go on")
                await self._finish(item, sid, queue.failure(item.request_id, err), None)
                continue
            try:
                g = group_from_item(item, sid, self.base_model)
            except (KeyError, TypeError, ValueError) as exc:
                await self._finish(item, sid, queue.failure(item.request_id, ServerError(f"malformed request: {exc}")),
                                   None)
                continue
            if await self.redis.exists(queue.cancel_key(g.request_id)):
                g.cancelled = True
            self.scheduler.add(g)

    async def _reclaimer(self) -> None:
        while not self.stopping:
            await asyncio.sleep(RECLAIM_EVERY_S)
            try:
                await self.reclaim()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("taking over a dead worker's requests failed; retrying")

    async def reclaim(self) -> int:
        """Take over the pending entries of generation workers that died and did not come back
        (another replica, or this one under an old name); returns how many were taken. Entries
        redelivered too often are failed by `_ingest`, as after a restart."""
        summary = await self.redis.xpending(self.stream, queue.SAMPLE_GROUP)
        pending = {_text(c["name"]): int(c["pending"]) for c in summary.get("consumers") or []}
        alive = {c for c in pending if await self.redis.exists(health.consumer_key(self.stream, c))}
        taken = 0
        for consumer in queue.orphaned_consumers(pending, alive, self.settings.consumer_name):
            stale = await self.redis.xpending_range(self.stream, queue.SAMPLE_GROUP, min="-", max="+", count=1000,
                                                    consumername=consumer, idle=RECLAIM_IDLE_MS)
            if not stale:
                continue
            # min_idle_time again: if two workers race, the second finds the entries freshly claimed.
            claimed = await self.redis.xclaim(self.stream, queue.SAMPLE_GROUP, self.settings.consumer_name,
                                              min_idle_time=RECLAIM_IDLE_MS,
                                              message_ids=[p["message_id"] for p in stale])
            if claimed:
                log.warning("taking over %d sampling requests of %s, which stopped", len(claimed), consumer)
                await self._ingest(claimed, check_redelivery=True)
                self.scheduler.wake()
                taken += len(claimed)
        return taken

    async def _delivery_counts(self) -> dict[str, int]:
        pending = await self.redis.xpending_range(self.stream, queue.SAMPLE_GROUP, min="-", max="+", count=10_000,
                                                  consumername=self.settings.consumer_name)
        return {_text(p["message_id"]): int(p["times_delivered"]) for p in pending}

    async def _cancellations(self) -> None:
        pubsub = self.redis.pubsub()
        await pubsub.subscribe(queue.CANCEL_CHANNEL)
        try:
            async for message in pubsub.listen():
                if message.get("type") == "message":
                    self.scheduler.cancel(_text(message["data"]))
        finally:
            await pubsub.aclose()

    # ------------------------------------------------------------------ results

    def _on_finish(self, g: Group, outcome: wire.SampleOutcome | QuiltError) -> None:
        item, stream_id = g.context
        if isinstance(outcome, QuiltError):
            result, usage = queue.failure(g.request_id, outcome), None
        else:
            result = queue.Outcome(g.request_id, result=wire.to_json(outcome))
            usage = (len(g.prompt) * g.n, sum(len(s.tokens) for s in outcome.sequences))
        self.scheduler.spawn(self._finish(item, stream_id, result, usage))

    async def _finish(self, item: queue.WorkItem, stream_id: str, outcome: queue.Outcome,
                      usage: tuple[int, int] | None) -> None:
        # Redis first so the waiting client is answered; then the durable record; then the ack.
        try:
            await queue.publish(self.redis, outcome, self.result_ttl_s)
            await self._db_call(self._record, item, outcome.error, usage)
            await self._ack(stream_id)
        except Exception:
            log.exception("could not finish %s", item.request_id)

    def _record(self, conn: psycopg.Connection, item: queue.WorkItem, error: dict | None,
                usage: tuple[int, int] | None) -> None:
        settle(conn, request_id=item.request_id, tenant_id=item.tenant_id, model_id=item.model_id or None,
               base_model=self.base_model, error=error,
               units=Units(prefill_tokens=usage[0], sample_tokens=usage[1]) if usage is not None else None)

    # ------------------------------------------------------------------ plumbing

    def _db(self) -> psycopg.Connection:
        self._conn = db.live_connection(self._conn, self.db_url)
        return self._conn

    async def _db_call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._db_thread, lambda: fn(self._db(), *args))

    async def _ack(self, stream_id: str) -> None:
        pipe = self.redis.pipeline()
        pipe.xack(self.stream, queue.SAMPLE_GROUP, stream_id)
        pipe.xdel(self.stream, stream_id)
        await pipe.execute()

    async def _beacon(self) -> None:
        now = time.time()
        if now - getattr(self, "_last_beacon", 0.0) < 2.0:
            return
        self._last_beacon = now
        s = self.scheduler
        await health.beacon_async(self.redis, health.gen_key(self.base_model), health.GEN_TTL_S,
                                  running=s.running(), waiting=s.waiting(), target=s.target, **s.report())
        await self.redis.set(health.consumer_key(self.stream, self.settings.consumer_name), b"1", ex=health.GEN_TTL_S)


async def _main_async() -> None:
    settings = get_gen_pool_settings()
    db_url = db.resolve_url()
    with db.connect(db_url) as conn:
        base = catalog.get_model_sync(conn, settings.base_model)
    if base is None:
        raise SystemExit(f"base model {settings.base_model!r} is not in the catalogue; run `quilt models create-tiny`")
    workdir = Path(get_core_settings().data_dir) / "gen"
    workdir.mkdir(parents=True, exist_ok=True)
    # Signals are handled from the start: dying by SIGTERM while the engine starts would orphan
    # vLLM's engine-core process.
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    engine = await GenEngine.start(base.path, settings, workdir)
    redis = redis_client.async_client(redis_client.resolve_url())
    worker = GenWorker(base_model=base.name, engine=engine, redis=redis, db_url=db_url, settings=settings,
                       result_ttl_s=get_api_settings().future_ttl_seconds)

    async def _stop_on_signal() -> None:
        await stop_requested.wait()
        worker.stop()

    watcher = asyncio.create_task(_stop_on_signal())
    try:
        if not stop_requested.is_set():
            await worker.run()
    finally:
        watcher.cancel()
        engine.shutdown()
        await redis.aclose()
    log.info("generation worker stopped")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(_main_async())


if __name__ == "__main__":
    main()
