"""The API's cache of callers (api.caller_cache): every change reaches it, whoever makes it, and
a cache that cannot hear about changes is not used."""

from __future__ import annotations

import asyncio
import time

import pytest
from stackutil import datum, fb_body, new_model, wait_future

from api.caller_cache import CallerCache, changing
from core import db
from tenancy.auth import Principal
from tenancy.keys import create_key


def _who(tenant: str) -> Principal:
    return Principal(tenant, tenant, "tenant", f"key-{tenant}", 1.0, 10, 10, 1000)


def _live() -> CallerCache:
    cache = CallerCache(max_age_s=60)
    cache.reset(live=True)
    return cache


def test_a_read_that_raced_an_invalidation_is_not_kept():
    cache = _live()
    before = cache.generation
    cache.invalidate("tenant:a")  # arrives while the read of a's key is on its way
    cache.put(before, "key", "h-a", _who("a"))
    assert cache.get("key", "h-a") is None
    cache.put(cache.generation, "key", "h-a", _who("a"))
    assert cache.get("key", "h-a") == _who("a")


def test_a_tenant_change_drops_its_keys_and_spend_only():
    cache = _live()
    for tenant in ("a", "b"):
        cache.put(cache.generation, "key", f"h-{tenant}", _who(tenant))
        cache.put(cache.generation, "spend", tenant, 5)
    cache.invalidate("tenant:a")
    assert cache.get("key", "h-a") is None and cache.get("spend", "a") is None
    assert cache.get("key", "h-b") == _who("b") and cache.get("spend", "b") == 5
    cache.invalidate("spend:b")
    assert cache.get("spend", "b") is None and cache.get("key", "h-b") == _who("b")


def test_nothing_is_served_while_the_cache_cannot_hear_changes_nor_past_its_age():
    cache = CallerCache(max_age_s=60)
    cache.put(cache.generation, "spend", "a", 5)  # not listening yet: not kept
    cache.reset(live=True)
    cache.put(cache.generation, "spend", "a", 5)
    cache.reset(live=False)  # the LISTEN connection dropped
    assert cache.get("spend", "a") is None
    aged = CallerCache(max_age_s=0.05)
    aged.reset(live=True)
    aged.put(aged.generation, "spend", "a", 5)
    time.sleep(0.1)
    assert aged.get("spend", "a") is None
    aged.put(aged.generation, "base", "x", object())
    aged.invalidate("no-such-kind:x")  # unknown: everything goes
    assert aged.get("base", "x") is None


def test_the_process_making_a_change_forgets_at_its_commit_not_at_the_notification(stack):
    """An operator's suspension must refuse the tenant's very next call to the same process, which
    can come before the change's notification does (CI saw it admitted once)."""
    async def go():
        cache = _live()
        async with db.async_pool(stack.database_url, max_size=1) as pool:
            cache.put(cache.generation, "key", "h-a", _who("a"))
            with pytest.raises(ZeroDivisionError):
                async with changing(pool, cache) as conn:
                    await conn.execute("SELECT 1")
                    1 / 0  # noqa: B018 - nothing committed: nothing to forget
            assert cache.get("key", "h-a") == _who("a")
            async with changing(pool, cache) as conn:
                await conn.execute("SELECT 1")
                assert cache.get("key", "h-a") == _who("a")  # until the commit
            assert cache.get("key", "h-a") is None and cache.live
    asyncio.run(go())


def _eventually(check, timeout_s: float = 5.0):
    """A change reaches each API process as a notification at commit: within milliseconds here,
    so `check` holds at once nearly always; the bound keeps a loaded machine from failing it."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.02)


def test_a_key_revoked_by_hand_in_sql_is_refused(stack, tenant):
    with db.connect(stack.database_url) as conn:
        secret, info = create_key(conn, tenant.tenant_id, name="by-hand")
    client = stack.http(secret)
    for _ in range(3):  # cached now
        assert client.post("/create_session", json={}).status_code == 200
    with db.connect(stack.database_url) as conn:
        conn.execute("UPDATE api_keys SET revoked_at = now() WHERE id = %s", (info.id,))
    assert _eventually(lambda: client.post("/create_session", json={}).status_code == 401)
    assert "revoked" in client.post("/create_session", json={}).json()["detail"]
    assert stack.http(tenant.key).post("/create_session", json={}).status_code == 200


def test_the_spend_header_follows_a_ledger_change(stack, tenant):
    client = stack.http(tenant.key)
    assert client.post("/create_session", json={}).headers["X-Quilt-Spend-USD"] == "0.000000"
    with db.connect(stack.database_url) as conn:
        conn.execute("INSERT INTO usage_daily (tenant_id, day, base_model, cost_micro_usd) "
                     "VALUES (%s, (now() AT TIME ZONE 'UTC')::date, 'quilt/tiny-qwen3', 1234567)", (tenant.tenant_id,))
    assert _eventually(lambda: client.post("/create_session", json={}).headers["X-Quilt-Spend-USD"] == "1.234567")


def test_get_info_follows_a_model_status_change_and_a_base_change(stack, tenant):
    client = stack.http(tenant.key)
    model_id = new_model(client, rank=4)
    info = client.post("/get_info", json={"model_id": model_id}).json()
    assert info["status"] == "ready" and info["model_data"]["arch"]
    with db.connect(stack.database_url) as conn:
        conn.execute("UPDATE training_models SET status = 'lost' WHERE id = %s", (model_id,))
    assert _eventually(lambda: client.post("/get_info", json={"model_id": model_id}).json()["status"] == "lost")
    with db.connect(stack.database_url) as conn:
        conn.execute("UPDATE training_models SET status = 'deleted' WHERE id = %s", (model_id,))
    assert _eventually(lambda: client.post("/get_info", json={"model_id": model_id}).status_code == 404)


def test_a_finished_future_answered_from_redis_is_still_only_its_tenants(stack, tenant):
    owner, other = stack.http(tenant.key), stack.http(stack.create_tenant("other").key)
    model_id = new_model(owner, rank=4)
    request_id = owner.post("/forward_backward", json=fb_body(model_id, 1, [datum([1, 2, 3, 4])])).json()["request_id"]
    assert "error" not in wait_future(owner, request_id)
    r = other.post("/retrieve_future", json={"request_id": request_id})
    assert r.status_code == 404 and r.json()["field"] == "request_id", r.text
    assert owner.post("/retrieve_future", json={"request_id": request_id}).status_code == 200


@pytest.mark.timeout(120)
def test_a_lost_listen_connection_turns_the_cache_off_until_it_is_back(stack, tenant):
    with db.connect(stack.database_url) as conn:
        secret, info = create_key(conn, tenant.tenant_id, name="listen")
    client = stack.http(secret)
    assert client.post("/create_session", json={}).status_code == 200
    with db.connect(stack.database_url) as conn:
        # Cut the API's LISTEN connection, then revoke while it is (perhaps) still reconnecting.
        cut = conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                           "WHERE query LIKE 'LISTEN quilt_caller_cache%%'").fetchall()
        assert cut, "the API process listens for changes"
        conn.execute("UPDATE api_keys SET revoked_at = now() WHERE id = %s", (info.id,))
    assert _eventually(lambda: client.post("/create_session", json={}).status_code == 401)
    # And it listens again (a connection each look: activity is a snapshot per transaction).
    assert _eventually(lambda: _listeners(stack) > 0)


def _listeners(stack) -> int:
    with db.connect(stack.database_url) as conn:
        return conn.execute("SELECT count(*) AS n FROM pg_stat_activity "
                            "WHERE query LIKE 'LISTEN quilt_caller_cache%%'").fetchone()["n"]
