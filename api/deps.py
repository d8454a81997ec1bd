"""Typed dependencies: the pool, Redis, settings and the authenticated caller.

Every dependency is `async def`: FastAPI runs a plain function in its thread pool, a hop that
cost a cheap call about a seventh of its CPU (bench/api_load.py).
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import Depends, Header, Request
from psycopg_pool import AsyncConnectionPool
from redis.asyncio import Redis

from api.caller_cache import CallerCache
from billing.budgets import month_to_date
from core import db
from core.settings import ApiSettings, get_api_settings
from tenancy.auth import Principal, authenticate
from tenancy.keys import hash_key


async def _pool(request: Request) -> AsyncConnectionPool:
    return request.app.state.pool


async def _redis(request: Request) -> Redis:
    return request.app.state.redis


async def _callers(request: Request) -> CallerCache:
    return request.app.state.callers


async def _settings() -> ApiSettings:
    return get_api_settings()


Pool = Annotated[AsyncConnectionPool, Depends(_pool)]
RedisDep = Annotated[Redis, Depends(_redis)]
Callers = Annotated[CallerCache, Depends(_callers)]
Settings = Annotated[ApiSettings, Depends(_settings)]


async def _principal(request: Request, pool: Pool, callers: Callers,
                     x_api_key: Annotated[str | None, Header()] = None) -> Principal:
    key_hash = hash_key(x_api_key).hex() if x_api_key else ""
    who = callers.get("key", key_hash) if key_hash else None
    spent = callers.get("spend", who.tenant_id) if who else None
    if who is None or spent is None:
        generation = callers.generation
        # A short-lived connection: routes that long-poll must not hold one while they wait.
        async with db.autocommit(pool) as conn:
            if who is None:
                who, spent = await authenticate(conn, x_api_key)
            else:
                spent = await month_to_date(conn, who.tenant_id)
        callers.put(generation, "key", key_hash, who)
        callers.put(generation, "spend", who.tenant_id, spent)
    request.state.tenant_id = who.tenant_id
    request.state.spend = (spent, time.monotonic())  # api.spend_header: reused if the answer comes soon
    request.state.who = who  # error handlers need the caller too (api.seq_gaps)
    return who


Who = Annotated[Principal, Depends(_principal)]
