"""The router's plumbing (gen_pool.router) on the stack's real Redis: the API's choice of replica
stream from the replicas' beacons, the fixed choice before any beacon, moving a dead replica's
groups (each exactly once, however many replicas try), and a moved group counting as a delivery.
A private base name per test, so the stack's own workers never see these entries."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import pytest

from core import health, queue, redis_client
from core.consumer import MAX_DELIVERIES, StreamConsumer
from core.work import AdapterRef, SampleWork, WorkItem, WorkKind
from gen_pool.params import SamplingSpec
from gen_pool.router import Router, reroute_dead_peers

pytestmark = pytest.mark.stack


@pytest.fixture
def base(r):
    name = f"test-route-{uuid.uuid4().hex[:8]}"
    yield name
    for key in r.keys(f"*{name}*"):
        r.delete(key)


def _item(adapter: str | None, n: int = 8, prompt=(1, 2, 3), episode: str | None = None) -> WorkItem:
    now = time.time()
    ref = AdapterRef(key=adapter, path=f"/x/{adapter}", model_id=f"m-{adapter}") if adapter else None
    work = SampleWork(prompt=tuple(prompt), n=n, spec=SamplingSpec(max_tokens=4), adapter=ref, submitted_at=now,
                      deadline_at=now + 600, episode_id=episode)
    return WorkItem(f"req-{uuid.uuid4().hex[:8]}", "tenant", "", 0, WorkKind.SAMPLE, 3, work)


def _beacon(r, base: str, name: str, *, running=0, waiting=0, target=64, adapters=(), at=0.0):
    r.set(health.gen_key(base, name), json.dumps({"at": at, "running": running, "waiting": waiting, "target": target,
                                                  "routing": {"adapters": list(adapters)}}), ex=30)


def _streams(router: Router, url: str, base: str, items: list[WorkItem]) -> list[str]:
    """The replica each item is routed to, through the async client the API uses."""
    async def go():
        aredis = redis_client.async_client(url)
        try:
            return [(await router.stream_for(aredis, base, it)).rsplit("@", 1)[1] for it in items]
        finally:
            await aredis.aclose()
    return asyncio.run(go())


def test_groups_follow_their_adapter_until_its_replica_is_full(stack, r, base):
    _beacon(r, base, "gen-0", adapters=["a"])
    _beacon(r, base, "gen-1", adapters=["b"])
    router = Router(2, "affinity", clock=lambda: 0.0)  # the beacons are read once, then never again
    got = _streams(router, stack.redis_url, base, [_item("b"), _item("a"), _item("b")] + [_item("b") for _ in range(14)])
    assert got[:3] == ["gen-1", "gen-0", "gen-1"]
    # A burst of one adapter's groups between two beacon reads: counted as they are sent, so past
    # 1.5x gen-1's target (96 sequences; 16 already went) they spill to gen-0, which now holds it too.
    assert got[3:13] == ["gen-1"] * 10 and got[13:] == ["gen-0"] * 4, got


def test_what_was_sent_since_a_beacon_counts_until_the_beacon_shows_it(stack, r, base):
    now = [1000.0]
    router = Router(2, "affinity", clock=lambda: now[0])
    _beacon(r, base, "gen-0", running=4, at=999.0)
    _beacon(r, base, "gen-1", at=999.0)
    assert _streams(router, stack.redis_url, base, [_item("x")]) == ["gen-1"]
    # Beacons taken before that group arrived: gen-1 looks busier and without x; the router still
    # knows it sent x there (and its 8 sequences), so x's next group follows it.
    _beacon(r, base, "gen-0", at=1000.5)
    _beacon(r, base, "gen-1", running=8, at=999.5)
    now[0] += 1.0
    assert _streams(router, stack.redis_url, base, [_item("x")]) == ["gen-1"]
    assert _streams(Router(2, "affinity", clock=lambda: now[0]), stack.redis_url, base, [_item("x")]) == ["gen-0"]


def test_before_any_beacon_a_group_goes_where_its_adapter_is_fixed(stack, r, base):
    router = Router(3, "affinity")
    first = _streams(router, stack.redis_url, base, [_item("a"), _item("b"), _item(None, prompt=(9, 9))])
    assert _streams(router, stack.redis_url, base, [_item("a"), _item("b"), _item(None, prompt=(9, 9))]) == first
    _beacon(r, base, "gen-0")
    _beacon(r, base, "gen-1")
    assert _streams(Router(3, "round_robin"), stack.redis_url, base, [_item("a") for _ in range(4)]) == \
        ["gen-0", "gen-1", "gen-0", "gen-1"]  # gen-2 has no beacon: not a candidate


def test_a_dead_replicas_groups_move_once_to_live_ones(r, base):
    names = queue.replica_names(3)
    streams = {n: queue.sample_stream(base, n) for n in names}
    for n in names:
        r.xgroup_create(streams[n], queue.SAMPLE_GROUP, id="0", mkstream=True)
    for n in ("gen-0", "gen-2"):  # alive: liveness keys and beacons; gen-1 has neither
        r.set(health.consumer_key(streams[n], n), b"1", ex=30)
        _beacon(r, base, n)
    sent = [_item(f"t{i}") for i in range(40)]
    for it in sent:
        r.xadd(streams["gen-1"], it.to_fields())
    r.xreadgroup(queue.SAMPLE_GROUP, "gen-1", {streams["gen-1"]: ">"}, count=15)  # in flight when it died

    moved: list[int] = []
    movers = [threading.Thread(target=lambda me=me: moved.append(reroute_dead_peers(r, base, me, 3, "affinity")))
              for me in ("gen-0", "gen-2") for _ in range(2)]
    for t in movers:
        t.start()
    for t in movers:
        t.join()
    assert sum(moved) == len(sent)
    assert r.xlen(streams["gen-1"]) == 0 and r.xpending(streams["gen-1"], queue.SAMPLE_GROUP)["pending"] == 0
    landed = [(WorkItem.from_fields(f).request_id, f[queue.MOVED_FIELD.encode()])
              for n in ("gen-0", "gen-2") for _, f in r.xrange(streams[n])]
    assert sorted(rid for rid, _ in landed) == sorted(it.request_id for it in sent)
    assert {m for _, m in landed} == {b"1"}
    assert r.xlen(streams["gen-0"]) and r.xlen(streams["gen-2"])  # load-balanced, not all on one
    assert reroute_dead_peers(r, base, "gen-0", 3, "affinity") == 0


def test_a_group_moved_too_often_is_failed_not_run(r, base):
    stream = queue.sample_stream(base, "gen-0")
    rows = []
    c = StreamConsumer(r, stream=stream, group=queue.SAMPLE_GROUP, consumer="gen-0",
                       settle=lambda item, outcome, usage: rows.append(outcome.ok), result_ttl_s=60,
                       liveness_ttl_s=30, what="sampled")
    c.ensure_group()
    fine, poison = _item("a"), _item("b")
    r.xadd(stream, {**fine.to_fields(), queue.MOVED_FIELD: "1"})
    r.xadd(stream, {**poison.to_fields(), queue.MOVED_FIELD: str(MAX_DELIVERIES + 1)})
    got = c.read()
    assert [d.item.request_id for d in got] == [fine.request_id]
    outcome = queue.Outcome.decode(poison.request_id, r.xrange(queue.future_key(poison.request_id))[0][1])
    assert not outcome.ok and "each of the last" in outcome.error["error"] and rows == [False]
