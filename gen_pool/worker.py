"""The generation worker: reads its base model's sample stream into the scheduler, and publishes
each group's result when its last sequence finishes.

The loop only moves data: Redis -> `Group`s -> Scheduler (plan_admission, pure; engine tasks) ->
results to Postgres (request rows, usage), then Redis (futures), then the stream entry is
acknowledged (core.consumer, the same stream plumbing as the trainer's). Everything runs on one
asyncio loop; stream reads and the finishing writes (Redis and Postgres) run on the consumer's two
threads so they never stall it. Cancellations arrive by pub/sub (any worker may hold the request).

Run: `python -m gen_pool.worker` (the embedded launcher does this, one per sampleable base model).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import cast

import psutil
import psycopg
from psycopg.rows import DictRow

from bases import architectures, catalog
from billing.ledger import settle
from billing.pricing import Units, sampling_units
from core import db, health, process_end, queue, redis_client, result_bytes, stores
from core.consumer import AsyncStreamConsumer, Delivery, StreamConsumer
from core.errors import QuiltError, ServerError
from core.records import Settled
from core.settings import (
    GenPoolSettings,
    get_api_settings,
    get_core_settings,
    get_gen_pool_settings,
    get_tenancy_settings,
)
from core.work import SampleWork, WorkItem
from gen_pool import episodes, outputs, stability, wire
from gen_pool.engine import GenEngine
from gen_pool.hf_engine import HFEngine
from gen_pool.router import Locality, reroute_dead_peers
from gen_pool.routing import Policy
from gen_pool.scheduler import Group, Scheduler

log = logging.getLogger("quilt.gen")

# A worker whose liveness key is gone (no beacon for QUILT_GEN_TAKEOVER_S) is dead: its pending
# entries are taken over once they have been idle that long too, checked this often.
RECLAIM_EVERY_S = 5.0
ROUTED_BEACON_S = 0.2
# A streamed request's tokens (core.queue.delta_key) outlive their reader by this much at most.
DELTA_TTL_S = 3600


def group_from_delivery(d: Delivery, base_model: str) -> Group:
    work = cast(SampleWork, d.item.body)  # what the generation pool's streams carry
    return Group(request_id=d.item.request_id, tenant_id=d.item.tenant_id, prompt=work.prompt, spec=work.spec,
                 n=work.n, adapter=work.adapter, model_id=work.adapter.model_id if work.adapter else base_model,
                 prompt_logprobs=work.prompt_logprobs, prompt_logprobs_last_n=work.prompt_logprobs_last_n,
                 prompt_topk=work.prompt_topk, sample_topk=work.sample_topk,
                 targets=outputs.PromptTargets.from_json(work.prompt_targets), alt_k=work.prompt_alt_k,
                 record_stability=work.record_stability, episode=work.episode_id, episode_hint=work.episode_hint,
                 images=work.images,
                 arrival=work.submitted_at, deadline=work.deadline_at, context=d)


class GenWorker:
    def __init__(self, *, base_model: str, engine: GenEngine | HFEngine, redis, sync_redis, db_url: str,
                 settings: GenPoolSettings, result_ttl_s: int, replicas: int = 1, routing: Policy = "affinity"):
        self.base_model = base_model
        self.engine = engine
        self.redis = redis  # asyncio client: cancellations, beacons
        self.sync_redis = sync_redis
        self.db_url = db_url
        self.settings = settings
        # With several replicas (QUILT_GEN_REPLICAS) each reads its own stream, which the API routes into.
        self.replicas, self.routing = replicas, routing
        try:
            self.replica = queue.replica_of(settings.consumer_name, replicas) if replicas > 1 else None
        except ValueError as exc:
            raise SystemExit(f"QUILT_GEN_CONSUMER_NAME: {exc}") from None
        self.locality = Locality()
        self.consumer = AsyncStreamConsumer(StreamConsumer(
            sync_redis, stream=queue.sample_stream(base_model, self.replica), group=queue.SAMPLE_GROUP,
            consumer=self.replica or settings.consumer_name, settle=self._settle, result_ttl_s=result_ttl_s,
            liveness_ttl_s=settings.takeover_s, what="sampled", batch=256))
        self.scheduler = Scheduler(engine, target=settings.concurrency_target, default_cap=settings.tenant_cap,
                                   levels=episodes.levels_of(settings), on_finish=self._on_finish)
        self.stopping = False
        self._deltas: asyncio.Queue = asyncio.Queue()
        self.max_result_bytes = get_tenancy_settings().max_result_bytes
        self._conn: psycopg.Connection[DictRow] | None = None
        self.heartbeat = health.Heartbeat(sync_redis, health.gen_key(base_model, self.replica))

    # ------------------------------------------------------------------ loop

    async def run(self) -> None:
        await self.consumer.ensure_group()
        await self.consumer.heartbeat()
        # Our own unacknowledged entries from before a crash come back first, unless they were
        # delivered so often that they are what keeps killing the engine.
        await self._ingest(await self.consumer.read(own_pending=True))
        tasks = [asyncio.create_task(self._reader(), name="reader"),
                 asyncio.create_task(self._cancellations(), name="cancels"),
                 asyncio.create_task(self._reclaimer(), name="reclaim"),
                 asyncio.create_task(self._delta_writer(), name="deltas")]
        self.heartbeat.start()
        log.info("generation worker for %s ready", self.base_model)
        try:
            while not self.stopping:
                self.scheduler.step()
                await self._beacon()
                if self.engine.dead:
                    raise ServerError("the engine died; exiting so the launcher restarts the worker")
                # At least every 2 s, to refresh the health figures; a routed replica's as they change.
                await self.scheduler.wait(2.0 if self.replica is None else ROUTED_BEACON_S)
        finally:
            self.heartbeat.stop()
            for t in tasks:
                t.cancel()
            self.scheduler.shutdown()
            self.consumer.shutdown()

    def stop(self) -> None:
        self.stopping = True
        self.scheduler.wake()

    # ------------------------------------------------------------------ intake

    async def _reader(self) -> None:
        while not self.stopping:
            try:
                deliveries = await self.consumer.read(block_ms=self.settings.read_block_ms)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reading the sample stream of %s failed; retrying", self.base_model)
                await asyncio.sleep(1.0)
                continue
            if deliveries:
                await self._ingest(deliveries)
                self.scheduler.wake()

    async def _ingest(self, deliveries: list[Delivery]) -> None:
        for d in deliveries:
            g = group_from_delivery(d, self.base_model)
            self.locality.note(g.prompt, g.episode)
            try:
                g.cancelled = bool(await self.redis.exists(queue.cancel_key(g.request_id)))
            except stores.STORE_ERRORS:
                pass  # Redis went down after the read: the group runs; a cancellation still arrives by pub/sub
            if cast(SampleWork, d.item.body).stream:
                g.on_tokens = functools.partial(self._stream_tokens, g.request_id, g.tenant_id)
            self.scheduler.add(g)

    def _stream_tokens(self, request_id: str, tenant_id: str, index: int, offset: int, tokens: tuple[int, ...]) -> None:
        # One writer task, first in first out: a stream's entries keep the order they were sampled in.
        self._deltas.put_nowait((request_id, tenant_id, index, offset, tokens))

    async def _delta_writer(self) -> None:
        while True:
            request_id, tenant_id, index, offset, tokens = await self._deltas.get()
            key = queue.delta_key(request_id)
            entry = {"i": str(index), "o": str(offset), "t": json.dumps(tokens)}
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.xadd(key, entry)
                    pipe.expire(key, DELTA_TTL_S)
                    result_bytes.note(pipe, tenant_id, sum(len(k) + len(v) for k, v in entry.items()), DELTA_TTL_S,
                                      self.max_result_bytes)
                    await pipe.execute()
            except stores.STORE_ERRORS as exc:  # the whole result still reaches the future
                log.warning("could not stream tokens of %s: %s", request_id, exc)

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
        """Take over the pending entries of generation workers that died and did not come back;
        returns how many were taken (core.consumer.StreamConsumer.reclaim)."""
        taken = await self.consumer.reclaim()
        if self.replicas > 1:  # a dead peer's stream: its groups go to live replicas (maybe this one)
            assert self.replica is not None  # named whenever there are several
            await asyncio.to_thread(reroute_dead_peers, self.sync_redis, self.base_model, self.replica,
                                    self.replicas, self.routing, db_url=self.db_url)
        if taken:
            await self._ingest(taken)
            self.scheduler.wake()
        return len(taken)

    async def _cancellations(self) -> None:
        while not self.stopping:
            pubsub = self.redis.pubsub()
            try:
                await pubsub.subscribe(queue.CANCEL_CHANNEL)
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        data = message["data"]
                        self.scheduler.cancel(data.decode() if isinstance(data, bytes) else data)
            except stores.STORE_ERRORS as exc:  # Redis restarting: subscribe again once it is back
                log.warning("cancellation channel lost (%s); resubscribing", exc)
                await asyncio.sleep(1.0)
            finally:
                await pubsub.aclose()

    # ------------------------------------------------------------------ results

    def _on_finish(self, g: Group, outcome: wire.SampleOutcome | QuiltError) -> None:
        records: dict[str, str] = {}
        if isinstance(outcome, QuiltError):
            result, usage = queue.failure(g.request_id, outcome), None
        else:
            result = queue.Outcome(g.request_id, result=wire.to_json(outcome))
            # Billed as any sample (billing.pricing.sampling_units): the prompt's tokens not in the
            # prefix cache once at the prefill rate, every other prompt token read at the cached
            # rate, and the sampled tokens. Top-k, target logprobs,
            # alternatives and stability records add nothing (their probes reread the prompt, mostly
            # from the prefix cache; QUILT_GEN_MAX_PROBE_ROWS bounds them).
            usage = sampling_units(len(g.prompt), tuple(r.cached_tokens if r else 0 for r in g.results),
                                   sum(len(s.tokens) for s in outcome.sequences))
            if g.record_stability:
                records = stability.records(g.request_id, outcome, len(g.prompt))
        self.scheduler.spawn(self._finish(g.context, result, usage, g.tenant_id, records))

    async def _finish(self, d: Delivery, outcome: queue.Outcome, usage: Units | None, tenant_id: str,
                      records: dict[str, str]) -> None:
        if records:  # before the result is published: a client holding the sequence ids finds them
            await self._record_stability(tenant_id, records)
        try:
            await self.consumer.finish(d, outcome, usage)
        except Exception:
            log.exception("could not finish %s", d.item.request_id)

    async def _record_stability(self, tenant_id: str, records: dict[str, str]) -> None:
        ttl = self.settings.stability_ttl_s
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for sid, body in records.items():
                    pipe.set(stability.key(tenant_id, sid), body, ex=ttl)
                    result_bytes.note(pipe, tenant_id, len(body), ttl, self.max_result_bytes)
                await pipe.execute()
        except stores.STORE_ERRORS as exc:  # the sample still succeeds; its records are missing (404)
            log.warning("could not record the stability of %s: %s", next(iter(records)), exc)

    def _settle(self, item: WorkItem, outcome: queue.Outcome, usage: Units | None) -> Settled | None:
        return settle(self._db(), request_id=item.request_id, tenant_id=item.tenant_id, model_id=item.model_id or None,
               base_model=self.base_model, error=outcome.error, units=usage)

    # ------------------------------------------------------------------ plumbing

    def _db(self) -> psycopg.Connection[DictRow]:
        # Only ever used from the consumer's write thread.
        self._conn = db.live_connection(self._conn, self.db_url,
                                        db.session_name("gen", self.replica, self.base_model) if self.replica else "")
        return self._conn

    async def _beacon(self) -> None:
        now = time.time()
        # Replicas the API routes by describe their load as it changes (at most every
        # ROUTED_BEACON_S); a lone worker's figures are for people, every 2 s.
        if now - getattr(self, "_last_beacon", 0.0) < (2.0 if self.replica is None else ROUTED_BEACON_S):
            return
        self._last_beacon = now
        s = self.scheduler
        routing = {} if self.replica is None else {"routing": {
            "adapters": self.engine.resident_adapters(), "cached_adapters": self.engine.cached_adapters(),
            **self.locality.report()}}
        self.heartbeat.update(running=s.running(), waiting=s.waiting(), target=s.target, **s.report(),
                              adapter_hits=self.engine.adapter_hits, adapter_misses=self.engine.adapter_misses,
                              adapters_tracked=self.engine.tracked_adapters(),
                              push=self.replica is not None, **routing)
        if self.replica is None or now - getattr(self, "_last_liveness", 0.0) >= 2.0:
            self._last_liveness = now
            await self.consumer.heartbeat()


def sampler_engine(base: catalog.BaseModel, settings: GenPoolSettings) -> architectures.SamplerEngine:
    """Which engine serves `base` here (bases.architectures.sampler_engine, QUILT_GEN_ENGINE)."""
    try:
        return architectures.sampler_engine(architectures.of_config(base.config),
                                            vllm_vision_imports=architectures.vllm_vision_imports(),
                                            choice=settings.engine)
    except ValueError as exc:
        raise SystemExit(f"base {base.name!r}: {exc}") from None


def _check_memory(base: catalog.BaseModel, settings) -> None:
    """Refuse, before vLLM loads anything, an engine that cannot fit (bases.memory_plan), naming the
    setting to change."""
    import torch

    from bases import memory_plan

    accelerator = torch.cuda.is_available()  # False where CUDA_VISIBLE_DEVICES hides every GPU
    problems = memory_plan.sampler_problems(
        base.config, accelerator=accelerator, dtype=settings.dtype, gen_memory_share=settings.gpu_memory_share,
        kv_cache_bytes=settings.kv_cache_gib * memory_plan.GiB, max_loras=settings.max_loras,
        max_lora_rank=settings.max_lora_rank, max_context=settings.max_model_len or base.max_context_length,
        device_memory=memory_plan.device_bytes("cuda") if accelerator else 0,
        ranks=settings.tensor_parallel * settings.pipeline_parallel, expert_lora=settings.expert_lora)
    if problems:
        raise SystemExit(f"base {base.name!r} does not fit this generation worker: " + "; ".join(problems))


def _end_while_starting(signum: int, frame: object) -> None:
    """SIGTERM or SIGINT before the engine is up. vLLM's start blocks the event loop until it is
    done, so the signal is acted on here, in the main thread, rather than queued for the loop:
    the engine's processes are killed and the worker exits. Their resource tracker is spared; it
    unlinks their shared memory once this process is gone (core.process_end)."""
    log.info("signal %d while the engine was starting: its processes are killed and the worker exits", signum)
    process_end.kill_all_but_trackers(psutil.Process().children(recursive=True))
    logging.shutdown()
    os._exit(0)  # at once: not after the start this interrupts, nor the interpreter's clean-up


async def _main_async() -> None:
    settings = get_gen_pool_settings()
    db_url = db.resolve_url()
    base = catalog.worker_base(db_url, settings.base_model)
    workdir = Path(get_core_settings().data_dir) / "gen"
    workdir.mkdir(parents=True, exist_ok=True)
    # Signals are handled from the start: dying by SIGTERM while the engine starts would orphan
    # vLLM's engine-core process, and waiting for the start to finish would keep a supervisor
    # waiting 10-25 s (here) for nothing.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _end_while_starting)
    engine: GenEngine | HFEngine
    if sampler_engine(base, settings) == "transformers":
        engine = await HFEngine.start(base.path, settings, workdir)
    else:
        _check_memory(base, settings)
        engine = await GenEngine.start(base.path, settings, workdir)
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    redis = redis_client.async_client(redis_client.resolve_url())
    core = get_core_settings()
    worker = GenWorker(base_model=base.name, engine=engine, redis=redis, sync_redis=redis_client.sync_client(),
                       db_url=db_url, settings=settings, result_ttl_s=get_api_settings().future_ttl_seconds,
                       replicas=core.gen_replicas, routing=core.gen_routing)

    async def _stop_on_signal() -> None:
        await stop_requested.wait()
        worker.stop()

    watcher = asyncio.create_task(_stop_on_signal())
    try:
        if not stop_requested.is_set():
            await worker.run()
    finally:
        watcher.cancel()
        # No grace: the engine holds nothing to save (its unfinished groups are still pending in
        # the stream, for the next worker), and its graceful exit took 5.1 s of a stop here.
        engine.shutdown(grace_s=0)
        await redis.aclose()
    log.info("generation worker stopped")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(_main_async())


if __name__ == "__main__":
    main()
