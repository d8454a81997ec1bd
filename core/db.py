"""Postgres access (psycopg 3): a sync connection for CLI and workers, an async pool for the API."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from core import embedded
from core.settings import CoreSettings, get_core_settings


def resolve_url(settings: CoreSettings | None = None) -> str:
    return embedded.database_url(settings or get_core_settings())


@contextlib.contextmanager
def connect(url: str | None = None) -> Iterator[psycopg.Connection]:
    """One transaction-per-block connection with dict rows (commits on success)."""
    with psycopg.connect(url or resolve_url(), row_factory=dict_row) as conn:
        yield conn


def live_connection(conn: psycopg.Connection | None, url: str) -> psycopg.Connection:
    """A worker's one autocommit connection for its small writes: `conn` if usable, else a new one."""
    if conn is None or conn.closed or conn.broken:
        conn = psycopg.connect(url, autocommit=True, row_factory=dict_row)
    return conn


@contextlib.asynccontextmanager
async def autocommit(pool: AsyncConnectionPool) -> AsyncIterator[psycopg.AsyncConnection]:
    """A pooled connection for one statement: no transaction, so no COMMIT round trip after it.
    Blocks that need several statements to be atomic use `pool.connection()` (one transaction)."""
    async with pool.connection() as conn:
        await conn.set_autocommit(True)
        try:
            yield conn
        finally:
            if not (conn.closed or conn.broken):
                await conn.set_autocommit(False)


def async_pool(url: str, *, max_size: int = 16) -> AsyncConnectionPool:
    """A pool for the API; open it in the app's lifespan."""
    return AsyncConnectionPool(
        url, min_size=1, max_size=max_size, open=False, kwargs={"row_factory": dict_row}
    )
