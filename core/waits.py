"""What one API request waited on: a pooled Postgres connection, Postgres round trips, Redis
round trips, each summed over the request.

The API's middleware opens a tally per request (`tally`) and reports it in `Server-Timing` beside
the request's whole time (`app;dur=3.1, pool;dur=0.0, pg;dur=1.2, redis;dur=0.4`). The API's pool
and Redis client add to it (`TimedPool`, `TimedConnection`, `TimedRedis`); outside a request
nothing is counted. bench/api_load.py reads it.

A wait runs from the call being sent to the coroutine resuming, so it holds the store's own time
and also the time the answer sat unread while the event loop ran other calls' steps. The rest of
`app` is the call's own steps and its queue before them. Which of the two made a wait long is what
the process's loop lag (core.loop_lag) tells: a late loop beside prompt stores is the API's own
queue, not the store's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import psycopg
import redis.asyncio as aioredis
from psycopg.rows import DictRow
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


@contextlib.contextmanager
def _timed(kind: int) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        spent = _TALLY.get()
        if spent is not None:
            spent[kind] += time.perf_counter() - started


class TimedConnection(psycopg.AsyncConnection[DictRow]):
    """An async connection whose statements and commits count as Postgres waits."""

    async def execute(self, *args: Any, **kwargs: Any) -> psycopg.AsyncCursor[DictRow]:
        with _timed(PG):
            return await super().execute(*args, **kwargs)

    async def commit(self) -> None:
        with _timed(PG):
            await super().commit()


class TimedPool(AsyncConnectionPool[psycopg.AsyncConnection[DictRow]]):
    """A pool whose checkouts count as waits for a connection."""

    async def getconn(self, timeout: float | None = None) -> psycopg.AsyncConnection[DictRow]:  # noqa: ASYNC109 - the pool's
        with _timed(POOL):
            return await super().getconn(timeout)


class TimedRedis(aioredis.Redis):
    """A Redis client whose commands (Lua calls included) count as Redis waits."""

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        with _timed(REDIS):
            return await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
