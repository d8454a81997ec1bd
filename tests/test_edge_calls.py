"""What one training call costs the API: SQL statements, pool checkouts and Redis commands between
the request arriving and its entry on the stream. Counted in-process (the app built against the
running stack's Postgres and Redis), so a change that adds a round trip to the hot path shows here.
`python -m pytest tests/test_edge_calls.py -s` prints the counts."""

from __future__ import annotations

import contextlib
from collections import Counter

import psycopg
import pytest
import redis.asyncio as aioredis
from fastapi.testclient import TestClient
from psycopg_pool import AsyncConnectionPool
from stackutil import datum, fb_body, new_model

from core.settings import clear_settings_cache

pytestmark = pytest.mark.stack

# The budget of round trips for a forward_backward on a model of the caller's (no budgets set):
# key lookup 1, model and base 1, in-flight count 1, budget lookup 1, request row and model touch 1,
# the spend header reads nothing (the key lookup brought the spend).
MAX_SQL = 5
MAX_CHECKOUTS = 2  # the key lookup, the admission transaction


@contextlib.contextmanager
def _counting():
    counts: Counter[str] = Counter()
    real_execute = psycopg.AsyncCursor.execute
    real_connection = AsyncConnectionPool.connection
    real_command = aioredis.Redis.execute_command

    async def execute(self, query, params=None, **kw):
        counts["sql"] += 1
        return await real_execute(self, query, params, **kw)

    def connection(self, *a, **kw):
        counts["checkouts"] += 1
        return real_connection(self, *a, **kw)

    async def command(self, *args, **kw):
        counts["redis"] += 1
        return await real_command(self, *args, **kw)

    psycopg.AsyncCursor.execute = execute
    AsyncConnectionPool.connection = connection
    aioredis.Redis.execute_command = command
    try:
        yield counts
    finally:
        psycopg.AsyncCursor.execute = real_execute
        AsyncConnectionPool.connection = real_connection
        aioredis.Redis.execute_command = real_command


@pytest.fixture
def app_client(stack, monkeypatch):
    monkeypatch.setenv("QUILT_DATABASE_URL", stack.database_url)
    monkeypatch.setenv("QUILT_REDIS_URL", stack.redis_url)
    monkeypatch.setenv("QUILT_DATA_DIR", str(stack.data_dir))
    clear_settings_cache()
    from api.app import create_app

    with TestClient(create_app(), base_url="http://test/api/v1") as client:
        yield client
    clear_settings_cache()


def test_a_forward_backward_costs_a_bounded_number_of_round_trips(stack, tenant, app_client):
    model_id = new_model(stack.http(tenant.key))
    body = fb_body(model_id, 1, [datum([5, 6, 7, 8, 9])])
    with _counting() as counts:
        r = app_client.post("/forward_backward", json=body, headers={"X-API-Key": tenant.key})
    assert r.status_code == 200, r.text
    print(f"\nforward_backward at the API: {counts['sql']} SQL statements, {counts['checkouts']} pool "
          f"checkouts, {counts['redis']} Redis commands")
    assert counts["sql"] <= MAX_SQL, counts
    assert counts["checkouts"] <= MAX_CHECKOUTS, counts
