"""The API as it was before the per-tenant quota lock (54e4d77): today's app with
`api.records.quota_lock` holding nothing and `locked_statement` running its statement alone, so a
counted insert is its one statement again. Served
only by bench/quota_lock_price.py, beside the real API on the same stores, to price the lock.

    uvicorn --factory _no_quota_lock:create_app   (PYTHONPATH=bench)
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
from api.app import create_app as _create_app


@asynccontextmanager
async def _no_lock(conn: object, tenant_id: str) -> AsyncIterator[None]:
    yield


async def _statement_alone(conn: AsyncConnection[DictRow], tenant_id: str, query: str,
                           params: dict[str, Any]) -> AsyncCursor[DictRow]:
    return await conn.execute(query, params)


def create_app() -> FastAPI:
    # Callers look both up on the module at each call, so replacing the attributes before the app
    # starts replaces them everywhere.
    records.quota_lock = _no_lock  # type: ignore[assignment]
    records.locked_statement = _statement_alone  # type: ignore[assignment]
    return _create_app()
