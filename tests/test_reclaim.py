"""Requests held by a worker that died are taken over by a live one (generation workers and the
trainer share the consumer); those of a worker that is alive (however long they run) are left alone."""

from __future__ import annotations

import time

from stackutil import wait_future

from core import consumer, db, health, ids, queue, redis_client
from core.work import (
    CreateModel,
    LoraShape,
    SampleWork,
    SamplingSpec,
    WorkItem,
    WorkKind,
)

TINY = "quilt/tiny-qwen3"


def test_orphaned_consumers_policy():
    pending = {"gen-0": 3, "gen-1": 2, "gen-2": 0, "gen-3": 5}
    assert consumer.orphaned_consumers(pending, alive={"gen-0", "gen-3"}, me="gen-0") == ["gen-1"]
    assert consumer.orphaned_consumers(pending, alive=set(), me="gen-1") == ["gen-0", "gen-3"]
    assert consumer.orphaned_consumers({}, alive=set(), me="gen-0") == []


def _deliver(stack, r, tenant, consumer: str) -> tuple[str, str]:
    """A base-model sample request, as the API writes it, read by `consumer` and nobody else (the
    add and the read are one transaction, so the stack's own worker never sees it as new)."""
    request_id, now = ids.new_request_id(), time.time()
    with db.connect(stack.database_url) as conn:
        conn.execute("INSERT INTO requests (id, tenant_id, model_id, seq_id, kind, n_tokens) "
                     "VALUES (%s, %s, NULL, NULL, 'sample', 6)", (request_id, tenant.tenant_id))
    work = SampleWork(prompt=(5, 6, 7), n=2, spec=SamplingSpec(max_tokens=4, eos_stops=False), adapter=None,
                      submitted_at=now, deadline_at=now + 600)
    item = WorkItem(request_id=request_id, tenant_id=tenant.tenant_id, model_id="", seq_id=0, kind=WorkKind.SAMPLE,
                    n_tokens=6, body=work)
    stream = queue.sample_stream(TINY)
    pipe = r.pipeline(transaction=True)
    pipe.xadd(stream, item.to_fields())
    pipe.xreadgroup(queue.SAMPLE_GROUP, consumer, {stream: ">"}, count=1)
    stream_id, read = pipe.execute()
    assert read and read[0][1][0][0] == stream_id, read
    return request_id, stream_id.decode()


def _owner(r, stream_id: str) -> str | None:
    rows = r.xpending_range(queue.sample_stream(TINY), queue.SAMPLE_GROUP, min=stream_id, max=stream_id, count=1)
    return rows[0]["consumer"].decode() if rows else None


def test_a_dead_workers_requests_are_taken_over(stack, tenant):
    r = redis_client.sync_client(stack.redis_url)
    stream = queue.sample_stream(TINY)
    busy_key = health.consumer_key(stream, "gen-busy")
    r.set(busy_key, b"1", ex=300)  # a live replica, with a request that runs long
    busy_id, busy_entry = _deliver(stack, r, tenant, "gen-busy")
    dead_id, dead_entry = _deliver(stack, r, tenant, "gen-dead")  # no liveness key: it died
    assert _owner(r, dead_entry) == "gen-dead"
    try:
        http = stack.http(tenant.key)
        result = wait_future(http, dead_id, timeout_s=120)
        assert [len(s["tokens"]) for s in result["sequences"]] == [4, 4], result
        status = None
        for _ in range(50):  # the result is published before the row is written
            with db.connect(stack.database_url) as conn:
                status = conn.execute("SELECT status FROM requests WHERE id = %s", (dead_id,)).fetchone()["status"]
            if status != "queued":
                break
            time.sleep(0.1)
        assert status == "done"
        # Idle far longer than the take-over threshold by now, yet still the live replica's.
        assert _owner(r, busy_entry) == "gen-busy"
    finally:
        r.delete(busy_key)
        r.xack(stream, queue.SAMPLE_GROUP, busy_entry)
        r.xdel(stream, busy_entry)
        with db.connect(stack.database_url) as conn:
            conn.execute("UPDATE requests SET status = 'failed', finished_at = now() WHERE id = %s", (busy_id,))


def test_a_dead_trainers_requests_are_taken_over(stack, tenant):
    """The trainer shares the consumer (core.consumer): a create_model held by a trainer consumer
    that died is taken over by the live trainer and answered."""
    r = redis_client.sync_client(stack.redis_url)
    request_id, model_id = ids.new_request_id(), f"{tenant.name}-takeover:train:0"
    with db.connect(stack.database_url) as conn:
        conn.execute("INSERT INTO requests (id, tenant_id, model_id, seq_id, kind) VALUES (%s, %s, %s, 0, 'create_model')",
                     (request_id, tenant.tenant_id, model_id))
    item = WorkItem(request_id, tenant.tenant_id, model_id, 0, WorkKind.CREATE_MODEL, 0, CreateModel(LoraShape(rank=4)))
    stream = queue.train_stream(TINY)
    pipe = r.pipeline(transaction=True)
    pipe.xadd(stream, item.to_fields())
    pipe.xreadgroup(queue.TRAIN_GROUP, "trainer-dead", {stream: ">"}, count=1)
    _, read = pipe.execute()
    assert read, read
    result = wait_future(stack.http(tenant.key), request_id, timeout_s=120)
    assert result == {"type": "create_model", "model_id": model_id}, result
    assert r.xpending_range(stream, queue.TRAIN_GROUP, min="-", max="+", count=10, consumername="trainer-dead") == []
