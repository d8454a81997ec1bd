"""Every route of the app goes through the input guard, a value the database still refuses is a
400, and a store that cannot be reached is a 503 with Retry-After (all without the stack)."""

from __future__ import annotations

import psycopg
from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from api import errors
from api.app import create_app
from api.input_guard import GuardedRoute


def test_every_route_of_the_app_is_guarded():
    routes = [r for r in create_app().routes if isinstance(r, APIRoute)]
    assert len(routes) > 30
    unguarded = [r.path for r in routes if not isinstance(r, GuardedRoute)]
    assert unguarded == []


def test_a_value_the_database_refuses_is_a_400_naming_the_body():
    app = FastAPI()
    errors.install(app)

    @app.get("/refused")
    async def refused():
        raise psycopg.errors.NumericValueOutOfRange("bigint out of range")

    r = TestClient(app).get("/refused")
    assert r.status_code == 400, r.text
    assert r.json()["category"] == "user" and r.json()["field"] == "body"


def test_a_store_that_cannot_be_reached_is_a_503_with_retry_after():
    import psycopg_pool
    import redis

    app = FastAPI()
    errors.install(app)
    raised = {"postgres": psycopg.OperationalError("connection refused"),
              "pool": psycopg_pool.PoolTimeout("couldn't get a connection after 30 sec"),
              "redis": redis.exceptions.ConnectionError("Error 111 connecting")}

    @app.get("/down/{store}")
    async def down(store: str):
        raise raised[store]

    client = TestClient(app)
    for store in raised:
        r = client.get(f"/down/{store}")
        assert r.status_code == 503, r.text
        assert r.headers["Retry-After"] == "1" and r.json()["category"] == "server"
