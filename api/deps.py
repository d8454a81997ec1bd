"""Typed dependencies: the pool, Redis, settings and the authenticated caller."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import Depends, Header, Request
from psycopg_pool import AsyncConnectionPool
from redis.asyncio import Redis

from core.settings import ApiSettings, get_api_settings
from tenancy.auth import Principal, authenticate


def _pool(request: Request) -> AsyncConnectionPool:
    return request.app.state.pool


def _redis(request: Request) -> Redis:
    return request.app.state.redis


Pool = Annotated[AsyncConnectionPool, Depends(_pool)]
RedisDep = Annotated[Redis, Depends(_redis)]
Settings = Annotated[ApiSettings, Depends(get_api_settings)]


async def _principal(request: Request, pool: Pool, x_api_key: Annotated[str | None, Header()] = None) -> Principal:
    # A short-lived connection: routes that long-poll must not hold one while they wait.
    async with pool.connection() as conn:
        who, spent = await authenticate(conn, x_api_key)
    request.state.tenant_id = who.tenant_id
    request.state.spend = (spent, time.monotonic())  # api.spend_header: reused if the answer comes soon
    request.state.who = who  # error handlers need the caller too (api.seq_gaps)
    return who


Who = Annotated[Principal, Depends(_principal)]
