"""Resolve an `X-API-Key` to the tenant it belongs to. The only place keys are checked."""

from __future__ import annotations

from dataclasses import dataclass

from psycopg import AsyncConnection

from billing.budgets import MONTH_TO_DATE_OF_T
from core.errors import Unauthenticated
from tenancy.keys import hash_key


@dataclass(frozen=True)
class Principal:
    """Who is calling: the tenant, its role and quotas, and which key they used."""

    tenant_id: str
    tenant_name: str
    role: str
    key_id: str
    plan_weight: float
    max_models: int
    max_inflight_requests: int
    tokens_per_minute: int
    suspended_kind: str | None = None  # "payment" or "operator" while suspended (tenancy.accounts)
    suspended_reason: str | None = None

    @property
    def is_operator(self) -> bool:
        return self.role == "operator"


_COLUMNS = ("k.id AS key_id, k.revoked_at, t.id AS tenant_id, t.name AS tenant_name, t.role, "
            "t.plan_weight, t.max_models, t.max_inflight_requests, t.tokens_per_minute, t.suspended_kind, "
            "t.suspended_reason")
_FROM = " FROM api_keys k JOIN tenants t ON t.id = k.tenant_id WHERE "
_PRINCIPAL = f"SELECT {_COLUMNS}{_FROM}"
_PRINCIPAL_AND_SPEND = f"SELECT {_COLUMNS}, {MONTH_TO_DATE_OF_T} AS spent{_FROM}"


async def _principal(conn: AsyncConnection, where: str, param: object) -> Principal:
    cur = await conn.execute(_PRINCIPAL + where, (param,))
    return _checked(await cur.fetchone())


def _checked(row: dict | None) -> Principal:
    if row is None:
        raise Unauthenticated("unknown API key", field="X-API-Key")
    if row.pop("revoked_at") is not None:
        raise Unauthenticated("this API key has been revoked; create a new one", field="X-API-Key")
    return Principal(**row)


async def authenticate(conn: AsyncConnection, api_key: str | None) -> tuple[Principal, int]:
    """The caller behind `api_key`, and its tenant's spend this month in micro-USD (for the spend
    header: read in the same statement, one round trip less per call)."""
    if not api_key:
        raise Unauthenticated("missing API key: send it in the X-API-Key header", field="X-API-Key")
    cur = await conn.execute(_PRINCIPAL_AND_SPEND + "k.key_hash = %s", (hash_key(api_key),))
    row = await cur.fetchone()
    spent = row.pop("spent") if row is not None else 0
    return _checked(row), int(spent)


async def principal_for_key_id(conn: AsyncConnection, key_id: str) -> Principal:
    """The caller behind a dashboard session, which holds the id of the key it logged in with (never
    the key): re-read on every request, so revoking that key or changing the role takes effect."""
    return await _principal(conn, "k.id = %s", key_id)
