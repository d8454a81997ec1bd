"""The stream consumer both workers share (core.consumer), on the stack's real Redis: delivery,
the redelivery cap, unreadable entries, take-over of a dead consumer's entries, and the finishing
order. A private stream per test, so the stack's own workers never see these entries."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from core import health, queue
from core.consumer import AsyncStreamConsumer, StreamConsumer
from core.errors import failure_from_json
from core.work import Rejected, WorkItem, WorkKind

pytestmark = pytest.mark.stack
GROUP = "testers"


class Ledger:
    """The settle callable a worker passes: here it records what it was asked to write."""

    def __init__(self):
        self.rows: list[tuple[str, bool, object]] = []

    def __call__(self, item, outcome, usage):
        self.rows.append((item.request_id, outcome.ok, usage))


@pytest.fixture
def stream(r):
    name = f"quilt:test:{uuid.uuid4().hex[:8]}"
    yield name
    r.delete(name)


def _consumer(r, stream, name, ledger, **kw) -> StreamConsumer:
    c = StreamConsumer(r, stream=stream, group=GROUP, consumer=name, settle=ledger, result_ttl_s=60,
                       liveness_ttl_s=30, what="tested", **kw)
    c.ensure_group()
    return c


def _item(n: int = 0) -> WorkItem:
    return WorkItem(f"req-{uuid.uuid4().hex[:8]}", "tenant", "m", n, WorkKind.REJECTED, 0, Rejected("x"))


def _future(r, request_id):
    entries = r.xrange(queue.future_key(request_id))
    return queue.Outcome.decode(request_id, entries[0][1]) if entries else None


def test_entries_arrive_typed_and_finishing_publishes_settles_and_acks(r, stream):
    ledger = Ledger()
    c = _consumer(r, stream, "c1", ledger)
    c.ensure_group()  # a second call finds the group and is fine
    item = _item(3)
    r.xadd(stream, item.to_fields())
    [d] = c.read(block_ms=1000)
    assert d.item == item
    c.finish(d, queue.Outcome(item.request_id, result={"ok": 1}), usage="units")
    assert _future(r, item.request_id).result == {"ok": 1}
    assert ledger.rows == [(item.request_id, True, "units")]
    assert r.xpending(stream, GROUP)["pending"] == 0 and r.xlen(stream) == 0


def test_an_entry_delivered_too_often_is_failed_not_run(r, stream):
    ledger = Ledger()
    c = _consumer(r, stream, "c1", ledger, max_deliveries=3)
    item = _item()
    r.xadd(stream, item.to_fields())
    assert len(c.read()) == 1  # delivery 1
    for _ in range(3):  # three restarts: deliveries 2, 3, 4 hand it back
        assert len(c.read(own_pending=True)) == 1
    assert c.read(own_pending=True) == []  # the fifth would be after 4 deliveries: failed instead
    outcome = _future(r, item.request_id)
    assert not outcome.ok and "each of the last 3 times" in outcome.error["error"]
    assert failure_from_json(outcome.error).category == "server"
    assert ledger.rows == [(item.request_id, False, None)]
    assert r.xpending(stream, GROUP)["pending"] == 0


def test_unreadable_entries_are_dropped_and_failed_when_they_name_a_request(r, stream):
    ledger = Ledger()
    c = _consumer(r, stream, "c1", ledger)
    r.xadd(stream, {"item": b"\xff not json"})
    r.xadd(stream, {"item": '{"request_id": "req-broken", "tenant_id": "t", "kind": "no-such-kind"}'})
    good = _item()
    r.xadd(stream, good.to_fields())
    assert [d.item for d in c.read()] == [good]
    broken = _future(r, "req-broken")
    assert broken is not None and "malformed request" in broken.error["error"]
    assert ledger.rows == [("req-broken", False, None)]  # its row is finished (failed), so not in flight
    assert r.xpending(stream, GROUP)["pending"] == 1  # only the good one waits for its finish


def test_a_dead_consumers_entries_are_taken_over_and_a_live_ones_are_not(r, stream):
    ledger = Ledger()
    dead, busy, me = (_consumer(r, stream, n, ledger, reclaim_idle_ms=0) for n in ("dead", "busy", "me"))
    r.xadd(stream, _item(1).to_fields())
    [held_by_dead] = dead.read()
    r.xadd(stream, _item(2).to_fields())
    [held_by_busy] = busy.read()
    busy.heartbeat()  # alive, however long its request runs
    try:
        taken = me.reclaim()
        assert [d.item for d in taken] == [held_by_dead.item]
        owners = {p["message_id"].decode(): p["consumer"].decode()
                  for p in r.xpending_range(stream, GROUP, min="-", max="+", count=10)}
        assert owners == {held_by_dead.stream_id: "me", held_by_busy.stream_id: "busy"}
        assert me.reclaim() == []  # nothing left to take
    finally:
        r.delete(health.consumer_key(stream, "busy"))


def test_the_async_face_runs_the_same_consumer(r, stream):
    ledger = Ledger()
    c = AsyncStreamConsumer(_consumer(r, stream, "c1", ledger))
    item = _item()
    r.xadd(stream, item.to_fields())

    async def go():
        [d] = await c.read(block_ms=1000)
        await c.finish(d, queue.failure(item.request_id, failure_from_json({"error": "no", "category": "user"})))
        return await c.read(block_ms=1)

    try:
        assert asyncio.run(go()) == []
    finally:
        c.shutdown()
    assert not _future(r, item.request_id).ok and ledger.rows == [(item.request_id, False, None)]


def test_a_kept_replay_log_comes_back_whole_and_finished_entries_are_never_failed(r, stream):
    ledger = Ledger()
    items = [_item(n) for n in range(5)]
    done = {items[0].request_id, items[1].request_id}
    c = _consumer(r, stream, "c1", ledger, max_deliveries=1, batch=2, finished=lambda ids: {i: "done" for i in done & set(ids)})
    for item in items:
        r.xadd(stream, item.to_fields())
    first = []
    while batch := c.read():
        first += batch
    for d in first[:2]:  # answered, but kept unacknowledged as the replay log
        c.finish(d, queue.Outcome(d.item.request_id, result={"ok": 1}), ack=False)
    assert r.xpending(stream, GROUP)["pending"] == 5
    c.read(own_pending=True)  # a restart: every entry delivered twice now
    again = c.read(own_pending=True)  # and again: over max_deliveries, except the answered ones
    assert [d.item.request_id for d in again] == [items[0].request_id, items[1].request_id]
    assert all(d.finished for d in again)
    # The three unanswered ones were failed (their worker kept dying); the answered ones stand.
    assert sorted(rid for rid, ok, _ in ledger.rows if not ok) == sorted(i.request_id for i in items[2:])
    assert _future(r, items[0].request_id).result == {"ok": 1}
