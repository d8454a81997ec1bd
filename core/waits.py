"""What one API request waited on: a pooled Postgres connection, Postgres round trips, Redis
round trips, each summed over the request.

The API's middleware opens a tally per request (`tally`) and reports it in `Server-Timing` beside
the request's whole time (`app;dur=3.1, pool;dur=0.0, pg;dur=1.2, redis;dur=0.4`), so a slow call
says whether it waited on a store or on the API's own event loop (its CPU, a pause, other calls
ahead of it). The API's pool and Redis client add to it (`TimedPool`, `TimedConnection`,
`TimedRedis`); outside a request nothing is counted. bench/api_load.py reads it.
"""

from __future__ import annotations

import time
from contextvars import ContextVar

import psycopg
import redis.asyncio as aioredis
from psycopg_pool import AsyncConnectionPool

POOL, PG, REDIS = 0, 1, 2
NAMES = ("pool", "pg", "redis")

# A list, not three ContextVars: tasks a request starts copy the context, and so share this list.
_TALLY: ContextVar[list[float] | None] = ContextVar("quilt_waits", default=None)


def tally() -> list[float]:
    """A new tally for the current request (seconds per kind of wait, indexed by POOL, PG, REDIS)."""
    spent = [0.0, 0.0, 0.0]
    _TALLY.set(spent)
    return spent


def server_timing(spent: list[float]) -> bytes:
    """`spent` as Server-Timing entries (milliseconds)."""
    return b", ".join(b"%s;dur=%.3f" % (name.encode(), s * 1000) for name, s in zip(NAMES, spent))


def _add(kind: int, started: float) -> None:
    spent = _TALLY.get()
    if spent is not None:
        spent[kind] += time.perf_counter() - started


class TimedConnection(psycopg.AsyncConnection):
    """An async connection whose statements and commits count as Postgres waits."""

    async def execute(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return await super().execute(*args, **kwargs)
        finally:
            _add(PG, started)

    async def commit(self) -> None:
        started = time.perf_counter()
        try:
            await super().commit()
        finally:
            _add(PG, started)


class TimedPool(AsyncConnectionPool):
    """A pool whose checkouts count as waits for a connection."""

    async def getconn(self, timeout: float | None = None):
        started = time.perf_counter()
        try:
            return await super().getconn(timeout)
        finally:
            _add(POOL, started)


class TimedRedis(aioredis.Redis):
    """A Redis client whose commands (Lua calls included) count as Redis waits."""

    async def execute_command(self, *args, **options):
        started = time.perf_counter()
        try:
            return await super().execute_command(*args, **options)
        finally:
            _add(REDIS, started)
