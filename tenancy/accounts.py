"""What an account's holder and an operator change about a tenant: suspension, and the audit trail
every such change leaves (migration 0011).

A suspended tenant keeps everything: its models, checkpoints, keys and usage stay readable and its
running work finishes, but new billable work (anything that meters tokens, and new models) is
refused at admission (api.admission), as an exhausted budget is: a `payment` suspension with 402,
an `operator` one with 403, each saying why and what to do. Lifting it takes effect on the next
call: the tenants row's change reaches every API process's cache of callers (migration 0009).

Audit rows are append-only (a trigger refuses UPDATE and DELETE). `actor` names who acted:
`key:<prefix>` for a call made with an API key, `account:<email>` for a member's dashboard session
(tenancy.auth.Principal.actor), `cli` for the operator's shell, `stripe` for a webhook.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import psycopg
from psycopg.rows import DictRow
from psycopg.types.json import Jsonb

from core.errors import BudgetExceeded, Forbidden, NotFound, QuiltError

SuspensionKind = Literal["payment", "operator"]

_SUSPEND = ("UPDATE tenants SET suspended_at = now(), suspended_kind = %s, suspended_reason = %s "
            "WHERE id = %s RETURNING id")
_RESTORE = ("UPDATE tenants SET suspended_at = NULL, suspended_kind = NULL, suspended_reason = NULL "
            "WHERE id = %s AND suspended_at IS NOT NULL AND (%s::text IS NULL OR suspended_kind = %s) RETURNING id")
_RECORD = "INSERT INTO audit_log (tenant_id, actor, action, detail) VALUES (%s, %s, %s, %s)"
_AUDIT = ("SELECT a.id, a.tenant_id, t.name AS tenant_name, a.actor, a.action, a.detail, a.at "
          "FROM audit_log a JOIN tenants t ON t.id = a.tenant_id "
          "WHERE (%(tenant)s::text IS NULL OR a.tenant_id = %(tenant)s) "
          "AND (%(before)s::bigint IS NULL OR a.id < %(before)s) "
          "AND (%(since)s::timestamptz IS NULL OR a.at >= %(since)s) "
          "AND (%(until)s::timestamptz IS NULL OR a.at < %(until)s) "
          "AND (%(resources)s::text[] IS NULL OR split_part(a.action, '.', 1) = ANY(%(resources)s)) "
          "ORDER BY a.id DESC LIMIT %(limit)s")


def suspension_refusal(kind: str, reason: str, tenant_name: str) -> QuiltError:
    """The refusal of new work for a suspended tenant: why, and what lifts it."""
    if kind == "payment":
        return BudgetExceeded(
            f"tenant {tenant_name!r} is suspended: {reason}. Update the payment method on the dashboard's "
            "billing page; service resumes as soon as the payment succeeds. Running work finishes and "
            "nothing is deleted.", field="tenant.suspended")
    return Forbidden(
        f"tenant {tenant_name!r} is suspended by an operator: {reason}. Contact your operator to lift it; "
        "running work finishes and nothing is deleted.", field="tenant.suspended")


# ---------------------------------------------------------------------------- the CLI's side (sync)

def record(conn: psycopg.Connection[DictRow], tenant_id: str, actor: str, action: str, **detail) -> None:
    """Append one audit row (in the caller's transaction: the change and its record commit together)."""
    conn.execute(_RECORD, (tenant_id, actor, action, Jsonb(detail)))


def suspend(conn: psycopg.Connection[DictRow], tenant_id: str, kind: SuspensionKind, reason: str, actor: str) -> None:
    """Suspend a tenant (again: the newer reason replaces the older) and record it."""
    with conn.transaction():
        if conn.execute(_SUSPEND, (kind, reason, tenant_id)).fetchone() is None:
            raise NotFound(f"no tenant {tenant_id!r}", field="tenant")
        record(conn, tenant_id, actor, "tenant.suspended", kind=kind, reason=reason)


def restore(conn: psycopg.Connection[DictRow], tenant_id: str, actor: str) -> bool:
    """Lift a suspension; False if the tenant was not suspended."""
    with conn.transaction():
        lifted = conn.execute(_RESTORE, (tenant_id, None, None)).fetchone() is not None
        if lifted:
            record(conn, tenant_id, actor, "tenant.restored")
    return lifted


# ------------------------------------------------------------------------------ the API's side (async)

async def record_async(conn: psycopg.AsyncConnection[DictRow], tenant_id: str, actor: str, action: str, **detail) -> None:
    """Async form of `record`."""
    await conn.execute(_RECORD, (tenant_id, actor, action, Jsonb(detail)))


async def suspend_async(conn: psycopg.AsyncConnection[DictRow], tenant_id: str, kind: SuspensionKind, reason: str,
                        actor: str) -> None:
    """Async form of `suspend` (the operator API), in the caller's transaction."""
    await conn.execute(_SUSPEND, (kind, reason, tenant_id))
    await record_async(conn, tenant_id, actor, "tenant.suspended", kind=kind, reason=reason)


async def restore_async(conn: psycopg.AsyncConnection[DictRow], tenant_id: str, actor: str,
                        only_kind: SuspensionKind | None = None) -> bool:
    """Async form of `restore`; with `only_kind`, only a suspension of that kind is lifted (a paid
    invoice lifts a payment suspension, not an operator's)."""
    lifted = await (await conn.execute(_RESTORE, (tenant_id, only_kind, only_kind))).fetchone() is not None
    if lifted:
        await record_async(conn, tenant_id, actor, "tenant.restored")
    return lifted


async def audit_rows(conn: psycopg.AsyncConnection[DictRow], tenant_id: str | None, *, limit: int,
                     before: int | None = None, since: datetime | None = None, until: datetime | None = None,
                     resources: list[str] | None = None) -> list[dict]:
    """Newest first; `tenant_id` None (operators) is every tenant's. `since`/`until` bound the time
    ([since, until)); `resources` keeps the actions of those resources (`budget` for `budget.set`)."""
    cur = await conn.execute(_AUDIT, {"tenant": tenant_id, "before": before, "limit": limit, "since": since,
                                      "until": until, "resources": resources})
    return await cur.fetchall()
