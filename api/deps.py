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

from api import caller_cache
from api.caller_cache import CallerCache
from core import db
from core.settings import ApiSettings, get_api_settings
from tenancy.auth import Principal, authenticate, missing_key
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
                     x_api_key: Annotated[str | None, Header()] = None,
                     authorization: Annotated[str | None, Header()] = None) -> Principal:
    if x_api_key is None and authorization and authorization[:7].lower() == "bearer ":
        x_api_key = authorization[7:].strip()  # OpenAI clients (api.routes.openai_compat)
    if not x_api_key:  # refused before a pooled connection is taken: an anonymous flood holds none
        raise missing_key()
    key_hash = hash_key(x_api_key).hex()
    who = callers.get("key", key_hash)
    if who is None:
        generation = callers.generation
        # A short-lived connection: routes that long-poll must not hold one while they wait. The key
        # and the spend in one statement: one round trip.
        async with db.autocommit(pool) as conn:
            who, spent = await authenticate(conn, x_api_key)
        callers.put(generation, "key", key_hash, who)
        callers.put(generation, "spend", who.tenant_id, spent)
    else:
        spent = await caller_cache.spend(callers, pool, who.tenant_id)
    request.state.tenant_id = who.tenant_id
    request.state.spend = (spent, time.monotonic())  # api.spend_header: reused if the answer comes soon
    request.state.who = who  # error handlers need the caller too (api.seq_gaps)
    return who


Who = Annotated[Principal, Depends(_principal)]
