"""A request's row is finished before its future is published, on every path that ends one: a
client that retries the moment it reads an answer finds its request no longer counted against its
quota (`max_inflight_requests` counts unfinished rows).

The first tests watch the order itself, on the stack's Postgres and Redis: a Redis client whose
future writes read the request's row just before they reach Redis, i.e. at the first instant any
reader could see the future. The last drives the real trainer and generation worker and reads each
row the instant a long-poll of its future returns."""

from __future__ import annotations

import math
import os
import threading
import time
import uuid

import pytest
from stackutil import TINY, base_sampler, datum, fb_body, new_model

from billing.ledger import settle
from billing.pricing import Units
from core import db, queue, records
from core.consumer import StreamConsumer
from core.errors import UserError
from core.work import Rejected, WorkItem, WorkKind

pytestmark = pytest.mark.stack
GROUP = "answer-order"
IN_FLIGHT = ("queued", "running")


class Watched:
    """The stack's Redis, except that a pipeline storing a future first reads its request's row:
    `seen[request id]` is the row's status at the moment the future became readable."""

    def __init__(self, redis, database_url: str):
        self._redis = redis
        self._conn = db.live_connection(None, database_url)
        self.seen: dict[str, str | None] = {}

    def __getattr__(self, name):
        return getattr(self._redis, name)

    def pipeline(self, *args, **kw):
        return _WatchedPipeline(self, self._redis.pipeline(*args, **kw))

    def status(self, request_id: str) -> str | None:
        row = self._conn.execute("SELECT status FROM requests WHERE id = %s", (request_id,)).fetchone()
        return row["status"] if row else None

    def close(self) -> None:
        self._conn.close()


class _WatchedPipeline:
    def __init__(self, watched: Watched, pipe):
        self._watched, self._pipe, self._futures = watched, pipe, []

    def __getattr__(self, name):
        return getattr(self._pipe, name)

    def xadd(self, key, fields, *args, **kw):
        name = key.decode() if isinstance(key, bytes) else key
        if name.startswith("quilt:future:"):
            self._futures.append(name.removeprefix("quilt:future:"))
        return self._pipe.xadd(key, fields, *args, **kw)

    def execute(self, *args, **kw):
        for request_id in self._futures:
            self._watched.seen[request_id] = self._watched.status(request_id)
        return self._pipe.execute(*args, **kw)


@pytest.fixture
def watched(stack, r):
    w = Watched(r, stack.database_url)
    yield w
    w.close()


@pytest.fixture
def conn(stack):
    c = db.live_connection(None, stack.database_url)  # autocommit, as the workers' own
    yield c
    c.close()


@pytest.fixture
def stream(r):
    name = f"quilt:test:{uuid.uuid4().hex[:8]}"
    yield name
    r.delete(name)


def _row(conn, tenant_id: str, kind: str = "forward_backward", *, marked: bool = True, redis=None) -> str:
    """A request row as admission leaves it (queued), with its append marker unless not `marked`."""
    request_id = f"req-{uuid.uuid4().hex[:12]}"
    conn.execute("INSERT INTO requests (id, tenant_id, kind) VALUES (%s, %s, %s)", (request_id, tenant_id, kind))
    if marked:
        redis.set(queue.enqueued_key(request_id), b"1", ex=600)
    return request_id


def _item(request_id: str, tenant_id: str) -> WorkItem:
    return WorkItem(request_id, tenant_id, "", 0, WorkKind.REJECTED, 0, Rejected("x"))


def _ledger(stack):
    """The settle callable a worker passes, writing to the stack's Postgres through the real ledger."""
    conn = db.live_connection(None, stack.database_url)

    def write(item, outcome, usage):
        return settle(conn, request_id=item.request_id, tenant_id=item.tenant_id, model_id=None, base_model=TINY,
                      error=outcome.error, units=usage)
    write.close = conn.close
    return write


def _consumer(redis, stream: str, ledger, **kw) -> StreamConsumer:
    c = StreamConsumer(redis, stream=stream, group=GROUP, consumer="c1", settle=ledger, result_ttl_s=600,
                       liveness_ttl_s=30, what="tested", **kw)
    c.ensure_group()
    return c


def _billed(conn, request_id: str) -> int:
    return conn.execute("SELECT count(*) AS n FROM usage_ledger WHERE request_id = %s", (request_id,)).fetchone()["n"]


def _answers(r, request_id: str) -> int:
    return r.xlen(queue.future_key(request_id))


OUTCOMES = {
    "success": lambda rid: queue.Outcome(rid, result={"loss": 1.5}),
    "user failure": lambda rid: queue.failure(rid, UserError("seq_id 1 never arrived", field="seq_id")),
    # Stored as a user failure (core.queue.storable): the row records that failure too.
    "unencodable result": lambda rid: queue.Outcome(rid, result={"loss": math.nan}),
}


@pytest.mark.parametrize("kind", list(OUTCOMES))
def test_a_finished_request_is_settled_before_its_future_is_readable(stack, tenant, watched, conn, r, stream, kind):
    ledger = _ledger(stack)
    try:
        c = _consumer(watched, stream, ledger)
        request_id = _row(conn, tenant.tenant_id, redis=r)
        r.xadd(stream, _item(request_id, tenant.tenant_id).to_fields())
        [d] = c.read(block_ms=1000)
        c.finish(d, OUTCOMES[kind](request_id), usage=Units(train_tokens=10))
    finally:
        ledger.close()
    stored = queue.Outcome.decode(request_id, r.xrange(queue.future_key(request_id))[0][1])
    expected = "done" if kind == "success" else "failed"
    assert watched.seen == {request_id: expected}
    row = conn.execute("SELECT status, error FROM requests WHERE id = %s", (request_id,)).fetchone()
    assert row["status"] == expected and row["error"] == stored.error
    assert _billed(conn, request_id) == (1 if kind == "success" else 0)


def test_a_request_failed_by_its_consumer_is_settled_before_its_future_is_readable(stack, tenant, watched, conn, r,
                                                                                  stream):
    """Over-delivered (it keeps killing its worker) and unreadable entries are failed by the
    consumer itself, on the same path."""
    ledger = _ledger(stack)
    try:
        c = _consumer(watched, stream, ledger, max_deliveries=1)
        killer = _row(conn, tenant.tenant_id, redis=r)
        r.xadd(stream, _item(killer, tenant.tenant_id).to_fields())
        broken = _row(conn, tenant.tenant_id, redis=r)
        r.xadd(stream, {"item": f'{{"request_id": "{broken}", "tenant_id": "{tenant.tenant_id}", "kind": "\\u0000"}}'})
        assert len(c.read()) == 1
        assert c.read(own_pending=True) and c.read(own_pending=True) == []  # the third delivery is one too many
    finally:
        ledger.close()
    assert watched.seen == {broken: "failed", killer: "failed"}


def test_a_request_never_enqueued_is_failed_before_its_failure_is_readable(stack, tenant, watched, conn, r):
    request_id = _row(conn, tenant.tenant_id, marked=False)
    conn.execute("UPDATE requests SET created_at = now() - interval '20 minutes' WHERE id = %s", (request_id,))
    with db.connect(stack.database_url) as upkeep:  # the connection the Celery task passes (not autocommit)
        assert request_id in records.fail_never_enqueued(upkeep, watched, ttl_s=3600)
    assert watched.seen == {request_id: "failed"}


def test_a_request_settled_but_never_published_is_answered_once_after_a_restart(stack, tenant, watched, conn, r,
                                                                                stream):
    """The worker died between settling and publishing. Its restart reads the entry back: a success
    runs again and is answered (billed once), a failure keeps its place and is answered from its
    row, and one whose answer got out is answered no second time."""
    ids = {name: _row(conn, tenant.tenant_id, redis=r) for name in ("lost success", "lost failure", "answered")}
    ledger = _ledger(stack)
    try:
        first = _consumer(r, stream, ledger)
        for request_id in ids.values():
            r.xadd(stream, _item(request_id, tenant.tenant_id).to_fields())
        delivered = {d.item.request_id: d for d in first.read()}
        for name, outcome in (("lost success", queue.Outcome(ids["lost success"], result={"ok": 1})),
                              ("lost failure", queue.failure(ids["lost failure"], UserError("bad datum")))):
            ledger(delivered[ids[name]].item, outcome, Units(train_tokens=10) if outcome.ok else None)  # then died
        first.finish(delivered[ids["answered"]], queue.Outcome(ids["answered"], result={"ok": 2}),
                     Units(train_tokens=10), ack=False)  # answered, kept pending (a replay log)

        def finished(request_ids):
            return records.finished_requests(conn, request_ids)

        restarted = _consumer(watched, stream, ledger, finished=finished)
        again = {d.item.request_id: d for d in restarted.read(own_pending=True)}
        # The trainer runs again only what is not finished; a failure's answer is its row.
        assert {name: again[rid].finished for name, rid in ids.items()} == \
            {"lost success": False, "lost failure": True, "answered": True}
        for d in again.values():  # the generation worker (no replay log) runs everything again
            restarted.finish(d, queue.Outcome(d.item.request_id, result={"ok": 3}), Units(train_tokens=10))
    finally:
        ledger.close()
    assert watched.seen == {ids["lost success"]: "done", ids["lost failure"]: "failed"}
    assert {name: _answers(r, rid) for name, rid in ids.items()} == {"lost success": 1, "lost failure": 1, "answered": 1}
    assert [_billed(conn, ids[n]) for n in ("lost success", "lost failure", "answered")] == [1, 0, 1]
    # The re-run could not turn the recorded failure into a success.
    lost = queue.Outcome.decode(ids["lost failure"], r.xrange(queue.future_key(ids["lost failure"]))[0][1])
    assert lost.error["error"] == "bad datum"


def test_a_failure_whose_future_was_never_published_is_answered_from_its_row(stack, tenant, conn, r):
    """A poll between a failed row and its future (the worker died there) reads the failure, not
    a 410; a success in that state is still on its way."""
    failed, done = _row(conn, tenant.tenant_id, redis=r), _row(conn, tenant.tenant_id, redis=r)
    ledger = _ledger(stack)
    try:
        ledger(_item(failed, tenant.tenant_id), queue.failure(failed, UserError("bad \x00 datum \udcff")), None)
        ledger(_item(done, tenant.tenant_id), queue.Outcome(done, result={"ok": 1}), None)
    finally:
        ledger.close()
    http = stack.http(tenant.key)
    answer = http.post("/retrieve_future", json={"request_id": failed}, timeout=60)
    assert answer.status_code == 200 and answer.json()["category"] == "user", answer.text
    assert answer.json()["request_id"] == failed and "bad" in answer.json()["error"]
    pending = http.post("/retrieve_future", json={"request_id": done}, timeout=60)
    assert pending.status_code == 200 and pending.json()["type"] == "try_again", pending.text
    r.delete(queue.enqueued_key(done))  # past its future's lifetime
    assert http.post("/retrieve_future", json={"request_id": done}, timeout=60).status_code == 410


def _watch(r, database_url: str, request_id: str, seen: dict, timeout_s: float) -> threading.Thread:
    """Long-poll a future as retrieve_future does; the instant it resolves, read its row."""
    def run():
        conn = db.live_connection(None, database_url)
        deadline, reply = time.monotonic() + timeout_s, None
        while not reply and time.monotonic() < deadline:  # in short polls: the client's socket timeout
            reply = r.xread({queue.future_key(request_id): "0-0"}, count=1, block=2000)
        row = conn.execute("SELECT status FROM requests WHERE id = %s", (request_id,)).fetchone()
        seen[request_id] = row["status"] if reply else "no answer"
        conn.close()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_the_real_workers_rows_are_finished_when_their_futures_resolve(stack, tenant, r):
    deadline_s = float(os.environ.get("QUILT_TRAINER_SEQ_GAP_DEADLINE_S", "20"))
    http = stack.http(tenant.key)
    model_id = new_model(http)
    sampler = base_sampler(http)
    started = {}

    def sample(seq_id: int, max_tokens: int) -> str:
        s = http.post("/asample", json={"sampling_session_id": sampler, "seq_id": seq_id, "num_samples": 1,
                                        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [40, 41, 42]}]},
                                        "sampling_params": {"max_tokens": max_tokens, "stop": []}})
        assert s.status_code == 200, s.text
        return s.json()["request_id"]

    def post(name: str, route: str, body: dict) -> None:
        resp = http.post(route, json=body)
        assert resp.status_code == 200, resp.text
        started[name] = resp.json()["request_id"]

    seen: dict[str, str] = {}
    watchers = []
    # seq 3 waits for a seq 2 that never comes: failed at the seq-gap deadline.
    post("seq-gap expiry", "/forward_backward", fb_body(model_id, 3, [datum([1, 2, 3])]))
    post("success", "/forward_backward", fb_body(model_id, 1, [datum([1, 2, 3])]))
    started["sample"] = sample(1, 3)
    started["cancelled sample"] = sample(2, 1900)
    for request_id in started.values():
        watchers.append(_watch(r, stack.database_url, request_id, seen, deadline_s + 120))
    assert http.post("/cancel_future", json={"request_id": started["cancelled sample"]}).status_code == 200
    for t in watchers:
        t.join(deadline_s + 150)
    assert {name: seen.get(rid) for name, rid in started.items()} == {
        "seq-gap expiry": "failed", "success": "done", "sample": "done", "cancelled sample": "failed"}
