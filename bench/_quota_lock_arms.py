"""The API with its quota lock taken other ways, served only by bench/quota_lock_price.py beside
the real API on the same stores, to price the lock:

- `unlocked`: the code before the lock (54e4d77): `api.records.quota_lock` holds nothing and
  `locked_statement` runs its statement alone, so a counted insert is its one statement again;
- `session_lock`: the lock as 54e4d77 took it on every path, the fast ones included: a session
  lock, the statement, its release (three round trips).

    uvicorn --factory _quota_lock_arms:unlocked_app   (PYTHONPATH=bench)
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from psycopg import AsyncConnection, AsyncCursor
from psycopg.rows import DictRow

from api import records
from api.app import create_app

_real_quota_lock = records.quota_lock


@asynccontextmanager
async def _no_lock(conn: object, tenant_id: str) -> AsyncIterator[None]:
    yield


async def _statement_alone(conn: AsyncConnection[DictRow], tenant_id: str, query: str,
                           params: dict[str, Any]) -> AsyncCursor[DictRow]:
    return await conn.execute(query, params)


async def _statement_in_session_lock(conn: AsyncConnection[DictRow], tenant_id: str, query: str,
                                     params: dict[str, Any]) -> AsyncCursor[DictRow]:
    async with _real_quota_lock(conn, tenant_id):
        return await conn.execute(query, params)  # its rows arrive with it: reading them later waits on nothing


# Callers look both up on the module at each call, so replacing the attributes before the app
# starts replaces them everywhere.

def unlocked_app() -> FastAPI:
    records.quota_lock = _no_lock  # type: ignore[assignment]
    records.locked_statement = _statement_alone  # type: ignore[assignment]
    return create_app()


def session_lock_app() -> FastAPI:
    records.locked_statement = _statement_in_session_lock  # type: ignore[assignment]
    return create_app()
