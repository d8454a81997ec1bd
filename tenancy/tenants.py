"""Tenants and their quotas."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg.rows import DictRow

from core import ids
from core.errors import Conflict, InvalidInput, NotFound
from core.numbers import INT32_MAX
from core.settings import get_tenancy_settings

ROLES = ("tenant", "operator")


@dataclass(frozen=True)
class Tenant:
    id: str
    name: str
    role: str
    plan_weight: float
    max_models: int
    max_inflight_requests: int
    tokens_per_minute: int
    max_checkpoint_bytes: int


_COLUMNS = "id, name, role, plan_weight, max_models, max_inflight_requests, tokens_per_minute, max_checkpoint_bytes"


_CREATE = (f"INSERT INTO tenants ({_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) "
           f"ON CONFLICT (name) DO NOTHING RETURNING {_COLUMNS}")


def _create_params(name: str, role: str, plan_weight: float) -> tuple:
    try:
        ids.check_name(name, "a tenant name")
    except ValueError as exc:
        raise InvalidInput(f"tenant: {exc}", field="tenant") from None
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}")
    quotas = get_tenancy_settings()
    return (ids.new_tenant_id(), name, role, plan_weight, quotas.max_models, quotas.max_inflight_requests,
            quotas.tokens_per_minute, quotas.max_checkpoint_bytes)


def _created(row: dict | None, name: str) -> Tenant:
    if row is None:
        raise Conflict(f"a tenant named {name!r} already exists", field="name")
    return Tenant(**row)


def create_tenant(conn: psycopg.Connection[DictRow], name: str, *, role: str = "tenant", plan_weight: float = 1.0) -> Tenant:
    return _created(conn.execute(_CREATE, _create_params(name, role, plan_weight)).fetchone(), name)


async def create_tenant_async(conn: psycopg.AsyncConnection[DictRow], name: str) -> Tenant:
    """Async form of `create_tenant` for a self-serve sign-up (role tenant, default quotas)."""
    return _created(await (await conn.execute(_CREATE, _create_params(name, "tenant", 1.0))).fetchone(), name)


def get_tenant_by_name(conn: psycopg.Connection[DictRow], name: str) -> Tenant:
    row = conn.execute(f"SELECT {_COLUMNS} FROM tenants WHERE name = %s", (name,)).fetchone()
    if row is None:
        raise NotFound(f"no tenant named {name!r}", field="name")
    return Tenant(**row)


async def tenant_id_named(conn: psycopg.AsyncConnection[DictRow], name: str) -> str | None:
    """The id of the tenant named `name` (an operator's lookup), or None."""
    row = await (await conn.execute("SELECT id FROM tenants WHERE name = %s", (name,))).fetchone()
    return row["id"] if row else None


def list_tenants(conn: psycopg.Connection[DictRow]) -> list[Tenant]:
    return [Tenant(**r) for r in conn.execute(f"SELECT {_COLUMNS} FROM tenants ORDER BY created_at")]


def set_quota(conn: psycopg.Connection[DictRow], name: str, *, tokens_per_minute: int | None = None,
              max_inflight_requests: int | None = None, max_models: int | None = None) -> Tenant:
    """Change a tenant's quotas (the ones given); they apply from the tenant's next call."""
    given = {"tokens_per_minute": tokens_per_minute, "max_inflight_requests": max_inflight_requests,
             "max_models": max_models}
    changes = {k: v for k, v in given.items() if v is not None}
    for key, value in changes.items():
        if not 1 <= value <= INT32_MAX:
            raise InvalidInput(f"{key} must be in [1, {INT32_MAX}], got {value}", field=key)
    if not changes:
        return get_tenant_by_name(conn, name)
    assignments = ", ".join(f"{k} = %s" for k in changes)  # keys from the fixed dict above
    row = conn.execute(f"UPDATE tenants SET {assignments} WHERE name = %s RETURNING {_COLUMNS}",
                       (*changes.values(), name)).fetchone()
    if row is None:
        raise NotFound(f"no tenant named {name!r}", field="name")
    return Tenant(**row)


PLAN_FIELDS = ("tokens_per_minute", "max_inflight_requests", "max_models", "plan_weight", "max_checkpoint_bytes")


async def set_plan_async(conn, tenant_id: str, changes: dict) -> dict:
    """Change a tenant's quotas and fair-share weight (keys of PLAN_FIELDS, values checked by the
    caller's schema); returns the row."""
    changes = {k: v for k, v in changes.items() if k in PLAN_FIELDS}
    if changes:
        assignments = ", ".join(f"{k} = %s" for k in changes)  # names from PLAN_FIELDS only
        await conn.execute(f"UPDATE tenants SET {assignments} WHERE id = %s", (*changes.values(), tenant_id))
    return await (await conn.execute(f"SELECT {', '.join(PLAN_FIELDS)} FROM tenants WHERE id = %s",
                                     (tenant_id,))).fetchone()
