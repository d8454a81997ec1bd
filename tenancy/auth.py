"""Resolve an `X-API-Key` to the tenant it belongs to. The only place keys are checked."""

from __future__ import annotations

from dataclasses import dataclass

from psycopg import AsyncConnection
from psycopg.rows import DictRow

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
    key_prefix: str = ""
    account_email: str | None = None  # a dashboard session of a member account (tenancy.members), not a key
    member_role: str = "owner"  # the key's or the account's role in its tenant (tenancy.roles)
    member_id: str | None = None  # the account calling, or the one that made the calling key
    max_checkpoint_bytes: int = 100 * 2**30  # bytes of live checkpoints (a save is refused past them)

    @property
    def is_operator(self) -> bool:
        """Operator power: an owner of an operator tenant, never its members or read-only keys."""
        return self.role == "operator" and self.member_role == "owner"

    @property
    def is_owner(self) -> bool:
        return self.member_role == "owner"

    @property
    def actor(self) -> str:
        """Who this is in the audit log: `key:<prefix>` or `account:<email>`."""
        return f"account:{self.account_email}" if self.account_email else f"key:{self.key_prefix}"


_TENANT_COLUMNS = ("t.id AS tenant_id, t.name AS tenant_name, t.role, t.plan_weight, t.max_models, "
                   "t.max_inflight_requests, t.tokens_per_minute, t.max_checkpoint_bytes, t.suspended_kind, "
                   "t.suspended_reason")
_COLUMNS = (f"k.id AS key_id, k.prefix AS key_prefix, k.revoked_at, k.role AS member_role, k.member_id, "
            f"{_TENANT_COLUMNS}")
_FROM = " FROM api_keys k JOIN tenants t ON t.id = k.tenant_id WHERE "
_PRINCIPAL = f"SELECT {_COLUMNS}{_FROM}"
_PRINCIPAL_AND_SPEND = f"SELECT {_COLUMNS}, {MONTH_TO_DATE_OF_T} AS spent{_FROM}"


async def _principal(conn: AsyncConnection[DictRow], where: str, param: object) -> Principal:
    cur = await conn.execute(_PRINCIPAL + where, (param,))
    return _checked(await cur.fetchone())


def _checked(row: dict | None) -> Principal:
    if row is None:
        raise Unauthenticated("unknown API key", field="X-API-Key")
    if row.pop("revoked_at") is not None:
        raise Unauthenticated("this API key has been revoked; create a new one", field="X-API-Key")
    return Principal(**row)


def missing_key() -> Unauthenticated:
    """The 401 for a call that sent no key (answered before any store is asked)."""
    return Unauthenticated("missing API key: send it in the X-API-Key header", field="X-API-Key")


async def authenticate(conn: AsyncConnection[DictRow], api_key: str | None) -> tuple[Principal, int]:
    """The caller behind `api_key`, and its tenant's spend this month in micro-USD (for the spend
    header: read in the same statement, one round trip less per call)."""
    if not api_key:
        raise missing_key()
    cur = await conn.execute(_PRINCIPAL_AND_SPEND + "k.key_hash = %s", (hash_key(api_key),))
    row = await cur.fetchone()
    spent = row.pop("spent") if row is not None else 0
    return _checked(row), int(spent)


async def principal_for_key_id(conn: AsyncConnection[DictRow], key_id: str) -> Principal:
    """The caller behind a dashboard session, which holds the id of the key it logged in with (never
    the key): re-read on every request, so revoking that key or changing the role takes effect."""
    return await _principal(conn, "k.id = %s", key_id)


_ACCOUNT = (f"SELECT '' AS key_id, '' AS key_prefix, a.email AS account_email, a.role AS member_role, "
            f"a.id AS member_id, {_TENANT_COLUMNS} "
            "FROM members a JOIN tenants t ON t.id = a.tenant_id WHERE a.id = %s AND a.removed_at IS NULL")


async def principal_for_account(conn: AsyncConnection[DictRow], account_id: str) -> Principal:
    """The caller behind a dashboard session of a member account (tenancy.members): re-read on every
    request, so removing the member or changing their role takes effect at once."""
    cur = await conn.execute(_ACCOUNT, (account_id,))
    row = await cur.fetchone()
    if row is None:
        raise Unauthenticated("this account was removed from its tenant; ask an owner to invite you again",
                              field="session")
    return Principal(**row)
