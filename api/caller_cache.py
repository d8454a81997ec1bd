"""Each API process's cache of who is calling: the principal behind a key, a tenant's spend this
month, a base by name, and the training model rows `get_info` shows.

Without it every call read the key, its tenant and the month-to-date spend from Postgres (and
`get_info` its model and base too): the largest share of a cheap call's time. Entries are dropped
as soon as Postgres says they changed: triggers (migration 0009) NOTIFY `quilt_caller_cache` at
the commit of every change to tenants, api_keys, usage_daily, base_models and a training model's
status or shape, whoever makes it (the CLI, the dashboard, a worker settling a ledger row, SQL by
hand), and each API process LISTENs on one connection of its own (`listen`). While that
connection is down the cache is off and every call reads Postgres as before; it comes back
empty, since notifications sent meanwhile are lost. So a revoked key is refused from the first
request after the revocation commits (give or take the notification's trip over loopback), and
`max_age_s` only bounds what a lost notification could cost. The process that makes a change does
not wait for that trip (`changing`): its client's next call, which may come before the
notification does, must already see the change (a suspension refuses it, a restore admits it).

A read that raced an invalidation is not remembered: `generation` counts invalidations, and an
entry fetched under an older generation is dropped instead of stored.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from psycopg.rows import DictRow

from bases import catalog
from bases.catalog import BaseModel
from billing.budgets import month_to_date
from core import db
from tenancy import scoped
from tenancy.auth import Principal

log = logging.getLogger("quilt.api.caller_cache")

CHANNEL = "quilt_caller_cache"
_MAX_ENTRIES = 100_000  # of one kind; past it that kind starts over rather than grow without bound
_RETRY_S = 0.5


class CallerCache:
    """Entries by kind: `key` (a Principal by key hash), `key_id` (a Principal by key id: an auth
    token's key, tenancy.tokens), `spend` (micro-USD by tenant id), `base` (a BaseModel by name)
    and `model` (a training model's row by id, as `get_info` reads it)."""

    KINDS = ("key", "key_id", "spend", "base", "model")

    def __init__(self, max_age_s: float):
        self.max_age_s = max_age_s
        self.live = False  # True only while the LISTEN connection is up
        self.generation = 0
        self._entries: dict[str, dict[str, tuple[Any, float]]] = {kind: {} for kind in self.KINDS}

    def get(self, kind: str, name: str):
        entry = self._entries[kind].get(name)
        if not self.live or entry is None or time.monotonic() - entry[1] > self.max_age_s:
            return None
        return entry[0]

    def put(self, generation: int, kind: str, name: str, value) -> None:
        """Store what was read under `generation` (taken before the read), unless the cache was
        invalidated since."""
        if not self.live or generation != self.generation:
            return
        entries = self._entries[kind]
        if len(entries) >= _MAX_ENTRIES:
            entries.clear()
        entries[name] = (value, time.monotonic())

    def invalidate(self, payload: str) -> None:
        """Apply one notification: `tenant:ID` (its keys and spend), `spend:ID`, `base:NAME` or
        `model:ID`."""
        self.generation += 1
        kind, _, name = payload.partition(":")
        if kind == "tenant":
            for keys in (self._entries["key"], self._entries["key_id"]):
                for held in [h for h, (who, _at) in keys.items() if who.tenant_id == name]:
                    del keys[held]
            self._entries["spend"].pop(name, None)
        elif kind in self._entries:
            self._entries[kind].pop(name, None)
        else:
            self.reset(live=self.live)

    def reset(self, *, live: bool) -> None:
        self.generation += 1
        self.live = live
        for entries in self._entries.values():
            entries.clear()


@asynccontextmanager
async def changing(pool, callers: CallerCache) -> AsyncIterator[psycopg.AsyncConnection[DictRow]]:
    """A connection for a change to what the cache holds (a tenant's quotas or suspension, a key):
    once it commits, this process forgets all it cached. Such changes are rare and whole-cache
    forgetting needs no knowledge of which entries they touch; other processes follow on the
    notification."""
    async with pool.connection() as conn:
        yield conn
    callers.reset(live=callers.live)


async def spend(callers: CallerCache, pool, tenant_id: str) -> int:
    """The tenant's month-to-date spend (`billing.budgets.month_to_date`), from the cache when it
    holds it."""
    spent = callers.get("spend", tenant_id)
    if spent is None:
        generation = callers.generation
        async with db.autocommit(pool) as conn:
            spent = await month_to_date(conn, tenant_id)
        callers.put(generation, "spend", tenant_id, spent)
    return spent


async def base_model(callers: CallerCache, conn: psycopg.AsyncConnection[DictRow], name: str) -> BaseModel | None:
    """A base by name (`bases.catalog.get_model`), from the cache when it holds it."""
    found = callers.get("base", name)
    if found is None:
        generation = callers.generation
        found = await catalog.get_model(conn, name)
        if found is not None:
            callers.put(generation, "base", name, found)
    return found


def cached_model(callers: CallerCache, who: Principal, model_id: str) -> dict | None:
    """`who`'s training model's row (as `tenancy.scoped.get_model` reads it) if the cache holds it;
    another tenant's model is not there for `who`."""
    model = callers.get("model", model_id)
    return model if model is not None and model["tenant_id"] == who.tenant_id else None


async def training_model(callers: CallerCache, conn: psycopg.AsyncConnection[DictRow], who: Principal, model_id: str) -> dict:
    """`who`'s training model's row (404 if not theirs), from the cache when it holds it. Its
    status may lag a change by a notification's trip: what admits work reads it again."""
    model = cached_model(callers, who, model_id)
    if model is None:
        generation = callers.generation
        model = await scoped.get_model(conn, who, model_id)
        callers.put(generation, "model", model_id, model)
    return model


async def listen(cache: CallerCache, url: str) -> None:
    """Keep `cache` in step with Postgres for the life of the process (a lifespan task): LISTEN,
    apply each notification, and on a lost connection turn the cache off until LISTEN is back."""
    while True:
        try:
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                await conn.execute(f"LISTEN {CHANNEL}")
                cache.reset(live=True)
                async for note in conn.notifies():
                    cache.invalidate(note.payload)
        except asyncio.CancelledError:
            cache.reset(live=False)
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the connection: off, then retry
            if cache.live:
                log.warning("caller cache off until Postgres answers again: %s", exc)
            cache.reset(live=False)
        await asyncio.sleep(_RETRY_S)
