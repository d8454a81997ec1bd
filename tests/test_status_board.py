"""The status page's pure parts as tables: component states from beacons, the 5xx windows, queue
waits per base, the beacons' wait figures; and the per-process response tally and cache, no stores."""

from __future__ import annotations

import asyncio

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api import errors
from api.response_tally import MAX_HELD_BUCKETS, ResponseTally
from api.routes.status import StatusCache
from api.status_board import (
    BUCKET_S,
    ResponseCounts,
    WorkerFacts,
    buckets_for,
    components,
    error_windows,
    overall,
    queue_waits,
    worker_state,
)
from core.errors import ServerError, Unavailable
from core.health import wait_figures

BEACON = {"at": 1.0, "pid": 4242, "queued": 3, "tenant_tokens": {"acme": 10}}


def _w(name="b", kind="trainer", beacon=BEACON, in_service=True, base="b") -> WorkerFacts:
    return WorkerFacts(kind, name, base, beacon, in_service)


@pytest.mark.parametrize(("beacon", "in_service", "redis_ok", "state"), [
    (BEACON, True, True, "up"),
    (None, True, True, "down"),          # its key expired: down
    (BEACON, False, True, "leaving"),    # a scaler took it out and it still beats
    (None, False, True, None),           # stopped on purpose: not shown
    (BEACON, True, False, "unknown"),    # Redis cannot be read: neither up nor down
    (None, True, False, "unknown"),
])
def test_worker_state(beacon, in_service, redis_ok, state):
    assert worker_state(_w(beacon=beacon, in_service=in_service), redis_ok=redis_ok) == state


def test_components_name_each_worker_and_carry_nothing_of_a_beacon():
    parts = components(postgres_ok=True, redis_ok=True, celery_beacon={"at": 1},
                       workers=[_w("b@shard-0"), _w("b@shard-1", beacon=None), _w("b", kind="gen")])
    assert [(c.id, c.label, c.state) for c in parts] == [
        ("api", "API", "up"), ("postgres", "Database (Postgres)", "up"), ("redis", "Queues (Redis)", "up"),
        ("trainer:b@shard-0", "Training · b (shard-0)", "up"), ("trainer:b@shard-1", "Training · b (shard-1)", "down"),
        ("gen:b", "Sampling · b", "up"), ("celery", "Upkeep (Celery)", "up")]
    shown = str([c.to_json() for c in parts])
    assert "4242" not in shown and "acme" not in shown and "queued" not in shown


@pytest.mark.parametrize(("postgres_ok", "redis_ok", "trainer", "celery", "expected"), [
    (True, True, BEACON, {"at": 1}, "ok"),
    (True, True, None, {"at": 1}, "degraded"),   # a trainer down
    (True, True, BEACON, None, "degraded"),      # upkeep down
    (False, True, BEACON, {"at": 1}, "down"),    # no store, no admission
    (True, False, BEACON, {"at": 1}, "down"),
])
def test_overall(postgres_ok, redis_ok, trainer, celery, expected):
    parts = components(postgres_ok=postgres_ok, redis_ok=redis_ok, workers=[_w(beacon=trainer)], celery_beacon=celery)
    assert overall(parts) == expected


def test_a_leaving_worker_does_not_degrade_the_service():
    parts = components(postgres_ok=True, redis_ok=True, workers=[_w(in_service=False)], celery_beacon={"at": 1})
    assert overall(parts) == "ok"


NOW = 1000.0 * BUCKET_S + 3  # 3 s into a bucket


@pytest.mark.parametrize(("counts", "expected"), [
    ({}, [(60, 0, 0, None), (300, 0, 0, None)]),
    # the current bucket counts in every window
    ({1000 * BUCKET_S: ResponseCounts(10, 1)}, [(60, 10, 1, 0.1), (300, 10, 1, 0.1)]),
    # six buckets make the minute: the sixth back is in, the seventh only in the longer window
    ({995 * BUCKET_S: ResponseCounts(4, 4), 994 * BUCKET_S: ResponseCounts(6, 0)},
     [(60, 4, 4, 1.0), (300, 10, 4, 0.4)]),
    # past the longest window: nowhere
    ({960 * BUCKET_S: ResponseCounts(5, 5)}, [(60, 0, 0, None), (300, 0, 0, None)]),
    # a bucket from the future (another host's clock ahead) is not read
    ({1001 * BUCKET_S: ResponseCounts(5, 5)}, [(60, 0, 0, None), (300, 0, 0, None)]),
])
def test_error_windows(counts, expected):
    got = error_windows(counts, NOW, windows_s=(60, 300))
    assert [(w.window_s, w.responses, w.errors, w.error_fraction) for w in got] == expected


def test_buckets_for_a_window_end_with_the_current_one():
    assert buckets_for(NOW, 30) == [1000 * BUCKET_S, 999 * BUCKET_S, 998 * BUCKET_S]
    assert buckets_for(NOW, 1) == [1000 * BUCKET_S]


def _waits(p50, p95, n=10):
    return {"queue_wait_p50_s": p50, "queue_wait_p95_s": p95, "queue_wait_n": n}


@pytest.mark.parametrize(("workers", "expected"), [
    # one trainer, one sampler
    ([_w(beacon=_waits(0.5, 2.0)), _w(kind="gen", beacon=_waits(0.1, 0.3, 4))],
     [("b", (0.5, 2.0, 10), (0.1, 0.3, 4))]),
    # shards: the slowest's figures, the requests summed; a dead shard adds nothing
    ([_w("b@shard-0", beacon=_waits(0.5, 2.0)), _w("b@shard-1", beacon=_waits(1.5, 1.8)),
      _w("b@shard-2", beacon=None)],
     [("b", (1.5, 2.0, 20), None)]),
    # a worker with no request yet, or none alive: None
    ([_w(beacon=_waits(None, None, 0)), _w(kind="gen", beacon=None)], [("b", None, None)]),
    # an older worker without the fields
    ([_w(beacon={"at": 1})], [("b", None, None)]),
    # bases apart
    ([_w(base="a", beacon=_waits(1, 1)), _w(base="b", beacon=_waits(2, 2))],
     [("a", (1.0, 1.0, 10), None), ("b", (2.0, 2.0, 10), None)]),
])
def test_queue_waits(workers, expected):
    def side(q):
        return None if q is None else (q.p50_s, q.p95_s, q.requests)

    assert [(b.base, side(b.training), side(b.sampling)) for b in queue_waits(workers)] == expected


@pytest.mark.parametrize(("waits", "expected"), [
    ([], (None, None, 0)),
    ([3.0], (3.0, 3.0, 1)),
    ([-0.01, 1.0], (1.0, 1.0, 2)),  # clocks a little apart: never a negative wait
    (list(range(100)), (50.0, 95.0, 100)),
])
def test_wait_figures(waits, expected):
    got = wait_figures(waits)
    assert (got["queue_wait_p50_s"], got["queue_wait_p95_s"], got["queue_wait_n"]) == expected


def test_the_tally_counts_per_bucket_and_keeps_what_it_could_not_publish():
    now = [NOW]
    tally = ResponseTally(clock=lambda: now[0])
    for status in (200, 404, 500, 503):
        tally.add(status)
    now[0] += BUCKET_S
    tally.add(200)
    taken = tally.take()
    assert taken == {1000 * BUCKET_S: [4, 2], 1001 * BUCKET_S: [1, 0]} and tally.pending == {}
    tally.add(502)
    tally.give_back(taken)
    assert tally.pending == {1000 * BUCKET_S: [4, 2], 1001 * BUCKET_S: [2, 1]}
    tally.give_back({b: [1, 0] for b in range(0, 200 * BUCKET_S, BUCKET_S)})
    assert len(tally.pending) == MAX_HELD_BUCKETS and max(tally.pending) == 1001 * BUCKET_S


def test_every_response_is_counted_where_its_request_id_is_set():
    tally = ResponseTally()
    app = FastAPI()
    errors.install(app, tally)

    @app.get("/ok")
    async def ok():
        return {}

    @app.get("/typed/{status}")
    async def typed(status: int):
        raise (Unavailable if status == 503 else ServerError)("no")

    @app.get("/crash")
    async def crash():
        raise RuntimeError("unexpected")

    @app.get("/api/v1/healthz")
    async def probe():
        raise Unavailable("a component is down")

    client = TestClient(app, raise_server_exceptions=False)
    assert [client.get(p).status_code for p in ("/ok", "/nowhere", "/typed/503", "/typed/500", "/crash",
                                                "/api/v1/healthz")] == [200, 404, 503, 500, 500, 503]
    # The probe's 503 reports a component; it is not a failure callers saw.
    assert [sum(c[0] for c in tally.pending.values()), sum(c[1] for c in tally.pending.values())] == [5, 3]


def test_the_cache_assembles_once_for_concurrent_readers_and_again_after_its_time():
    now = [0.0]
    cache = StatusCache(ttl_s=2.0, clock=lambda: now[0])
    made = []

    async def assemble():
        made.append(now[0])
        await asyncio.sleep(0.01)
        return {"n": len(made)}

    async def scenario():
        first = await asyncio.gather(*(cache.get(assemble) for _ in range(20)))
        now[0] = 1.9
        cached = await cache.get(assemble)
        now[0] = 2.0
        fresh = await cache.get(assemble)
        cache.drop()
        dropped = await cache.get(assemble)
        return first, cached, fresh, dropped

    first, cached, fresh, dropped = asyncio.run(scenario())
    assert {d["n"] for d in first} == {1} and cached == {"n": 1} and fresh == {"n": 2} and dropped == {"n": 3}
