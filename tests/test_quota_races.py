"""Quotas counted and spent atomically (issue 46 item 5): a burst of one tenant's calls cannot all
see the last free place. Before the quota lock, 12 concurrent create_model with room for 2 admitted
3 (and more on a faster machine); sessions had no bound at all."""

from __future__ import annotations

import asyncio

import httpx
from stackutil import TINY, datum, fb_body, new_model, second_api

from core import db
from tenancy.tenants import set_quota


async def _burst(base_url: str, key: str, calls) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base_url + "/api/v1", timeout=120, headers={"X-API-Key": key}) as client:
        return await asyncio.gather(*(call(client) for call in calls))


def test_concurrent_create_model_admits_exactly_the_room_left(stack):
    tenant = stack.create_tenant("race-models")
    with db.connect(stack.database_url) as conn:
        set_quota(conn, tenant.name, max_models=2)
    session_id = httpx.post(stack.base_url + "/api/v1/create_session", json={},
                            headers={"X-API-Key": tenant.key}).json()["session_id"]

    def create(seq: int):
        return lambda c: c.post("/create_model", json={"session_id": session_id, "model_seq_id": seq,
                                                       "base_model": TINY, "lora_config": {"rank": 4}})

    answers = asyncio.run(_burst(stack.base_url, tenant.key, [create(i) for i in range(12)]))
    codes = sorted(r.status_code for r in answers)
    assert codes.count(200) == 2, [(r.status_code, r.text[:200]) for r in answers]
    assert codes.count(403) == 10
    refused = next(r for r in answers if r.status_code == 403)
    assert refused.json()["field"] == "max_models"


def test_live_sessions_are_bounded_atomically(stack, tmp_path):
    tenant = stack.create_tenant("race-sessions")
    with second_api(stack, tmp_path, QUILT_MAX_LIVE_SESSIONS_PER_TENANT="3") as url:
        answers = asyncio.run(_burst(url, tenant.key, [lambda c: c.post("/create_session", json={})] * 10))
        codes = sorted(r.status_code for r in answers)
        assert codes.count(200) == 3 and codes.count(429) == 7, codes
        refused = next(r for r in answers if r.status_code == 429)
        assert refused.json()["field"] == "session_id" and "3 live sessions" in refused.json()["error"]
        assert "retry-after" in refused.headers
        # Finishing one frees its place; another tenant was never affected.
        first = next(r for r in answers if r.status_code == 200).json()["session_id"]
        with httpx.Client(base_url=url + "/api/v1", timeout=60, headers={"X-API-Key": tenant.key}) as c:
            assert c.post(f"/sessions/{first}/finish", json={"reason": {}}).status_code == 200
            assert c.post("/create_session", json={}).status_code == 200
            assert c.post("/create_session", json={}).status_code == 429
        other = stack.create_tenant("race-sessions-b")
        r = httpx.post(url + "/api/v1/create_session", json={}, headers={"X-API-Key": other.key}, timeout=60)
        assert r.status_code == 200


def test_concurrent_calls_on_a_model_admit_exactly_the_inflight_room(stack):
    """The fast path (a call on an existing model: one statement, under the lock in the same round
    trip, records.locked_statement) counts and inserts atomically too: of a burst past the
    in-flight quota, exactly the room left goes to the trainer and the rest wait in a queue state."""
    tenant = stack.create_tenant("race-inflight")
    client = stack.http(tenant.key)
    model_id = new_model(client)
    with db.connect(stack.database_url) as conn:
        set_quota(conn, tenant.name, max_inflight_requests=3)

    def submit(seq: int):  # seq_ids past 1, which never comes: the admitted ones stay in flight
        return lambda c: c.post("/forward_backward", json=fb_body(model_id, seq, [datum([1, 2, 3])]))

    answers = asyncio.run(_burst(stack.base_url, tenant.key, [submit(seq) for seq in range(2, 14)]))
    assert all(r.status_code == 200 for r in answers), [(r.status_code, r.text[:200]) for r in answers]
    with db.connect(stack.database_url) as conn:
        rows = conn.execute("SELECT status, count(*) AS n FROM requests WHERE model_id = %s AND seq_id >= 2 "
                            "GROUP BY status", (model_id,)).fetchall()
    statuses = {r["status"]: r["n"] for r in rows}
    assert statuses.get("queued", 0) + statuses.get("running", 0) == 3 and statuses.get("paused") == 9, statuses
