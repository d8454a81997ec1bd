"""Postgres access (psycopg 3): a sync connection for CLI and workers, an async pool for the API."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any, TypeVar

import psycopg
from psycopg.rows import DictRow, dict_row
from psycopg_pool import AsyncConnectionPool

from core import embedded, waits
from core.settings import CoreSettings, get_core_settings

#: The connections this project opens: all of them with dict rows (row_factory=dict_row).
Conn = psycopg.Connection[DictRow]
AsyncConn = psycopg.AsyncConnection[DictRow]

_Row = TypeVar("_Row")


def one(row: _Row | None) -> _Row:
    """The row of a statement that always returns one (an aggregate, an INSERT ... RETURNING, a row
    the transaction holds): `fetchone()`'s None ruled out."""
    if row is None:
        raise LookupError("the statement returned no row")
    return row


def resolve_url(settings: CoreSettings | None = None) -> str:
    return embedded.database_url(settings or get_core_settings())


@contextlib.contextmanager
def connect(url: str | None = None) -> Iterator[Conn]:
    """One transaction-per-block connection with dict rows (commits on success)."""
    with psycopg.connect(url or resolve_url(), row_factory=dict_row) as conn:
        yield conn


def live_connection(conn: Conn | None, url: str, name: str = "") -> Conn:
    """A worker's one autocommit connection for its small writes: `conn` if usable, else a new one
    (`name`: its application_name, by which a peer can end its sessions, scaleout.placement)."""
    if conn is None or conn.closed or conn.broken:
        named: dict[str, Any] = {"application_name": name} if name else {}
        conn = psycopg.connect(url, autocommit=True, row_factory=dict_row, **named)
    return conn


def session_name(role: str, worker: str, base_model: str) -> str:
    """The application_name of a worker's Postgres sessions (`live_connection`), by which a peer
    taking its work over ends them (`end_sessions`); Postgres keeps at most 63 bytes of it."""
    return f"quilt-{role} {worker} {base_model}"[:63]


def end_sessions(conn: Conn, name: str) -> int:
    """End every session named `name` but this one: fencing's Postgres half. A worker that is frozen
    or cut off, not dead, may hold row locks in an open transaction (a settle it was in) that would
    stall the peer re-running its work; ending its sessions rolls that back, and should it wake
    it reconnects and its own fence (or the settle's once-only rule) stops it doing harm."""
    return len(conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s "
                            "AND pid <> pg_backend_pid()", (name,)).fetchall())


@contextlib.asynccontextmanager
async def autocommit(pool: AsyncConnectionPool[AsyncConn]) -> AsyncIterator[AsyncConn]:
    """A pooled connection for one statement: no transaction, so no COMMIT round trip after it.
    Blocks that need several statements to be atomic use `pool.connection()` (one transaction)."""
    async with pool.connection() as conn:
        await conn.set_autocommit(True)
        try:
            yield conn
        finally:
            if not (conn.closed or conn.broken):
                await conn.set_autocommit(False)


def async_pool(url: str, *, max_size: int = 16) -> AsyncConnectionPool[AsyncConn]:
    """A pool for the API; open it in the app's lifespan. Its checkouts and statements count in
    the current request's waits (core.waits)."""
    return waits.TimedPool(url, min_size=1, max_size=max_size, open=False, connection_class=waits.TimedConnection,
                           kwargs={"row_factory": dict_row})


async def ping(conn: AsyncConn) -> None:
    """One round trip to Postgres (a health check): raises if it cannot answer."""
    await conn.execute("SELECT 1")
