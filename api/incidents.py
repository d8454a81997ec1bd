"""The status page's incident notes (`status_incidents`, migrations/0022): operators write them
through the API, anyone reads them on the page. Service-wide rows, not a tenant's; who wrote one is
kept for the audit log and never shown."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from core.db import AsyncConn, one
from core.errors import InvalidInput, NotFound
from tenancy import accounts

TITLE_MAX = 200  # characters; migrations/0022 checks the same bounds
BODY_MAX = 4000
SHOWN = 20  # notes on the page: every open one and the newest resolved, newest first
RESOLVED_SHOWN_DAYS = 7

_COLUMNS = "id, title, body, severity, started_at, resolved_at"

_RECENT = f"""
SELECT {_COLUMNS} FROM status_incidents
WHERE resolved_at IS NULL OR resolved_at > now() - make_interval(days => %(days)s)
ORDER BY resolved_at IS NOT NULL, started_at DESC, id DESC
LIMIT %(limit)s
"""


def to_json(row: dict) -> dict:
    return {"id": row["id"], "title": row["title"], "body": row["body"], "severity": row["severity"],
            "started_at": row["started_at"].isoformat(),
            "resolved_at": row["resolved_at"].isoformat() if row["resolved_at"] else None}


def check_span(started_at: datetime, resolved_at: datetime | None) -> None:
    if resolved_at is not None and resolved_at < started_at:
        raise InvalidInput(f"resolved_at: {resolved_at.isoformat()} is before started_at {started_at.isoformat()}",
                           field="resolved_at")


async def recent(conn: AsyncConn) -> list[dict[str, Any]]:
    """The notes the page shows: open ones first, then those resolved in the last week."""
    cur = await conn.execute(_RECENT, {"days": RESOLVED_SHOWN_DAYS, "limit": SHOWN})
    return [to_json(r) for r in await cur.fetchall()]


async def post(conn: AsyncConn, *, title: str, body: str, severity: str, started_at: datetime,
               resolved_at: datetime | None, tenant_id: str, actor: str) -> dict[str, Any]:
    """Write a note, and its audit row in the operator's tenant, in the caller's transaction."""
    check_span(started_at, resolved_at)
    cur = await conn.execute(
        f"INSERT INTO status_incidents (title, body, severity, started_at, resolved_at, created_by) "
        f"VALUES (%s, %s, %s, %s, %s, %s) RETURNING {_COLUMNS}",
        (title, body, severity, started_at, resolved_at, actor))
    row = one(await cur.fetchone())
    await accounts.record_async(conn, tenant_id, actor, "incident.posted", incident=row["id"], severity=severity)
    return to_json(row)


async def resolve(conn: AsyncConn, incident_id: int, resolved_at: datetime, *, tenant_id: str,
                  actor: str) -> dict[str, Any]:
    """Mark a note resolved at `resolved_at` (again: the newer time stands)."""
    cur = await conn.execute("SELECT started_at FROM status_incidents WHERE id = %s FOR UPDATE", (incident_id,))
    found = await cur.fetchone()
    if found is None:
        raise NotFound(f"no incident {incident_id}", field="incident_id")
    check_span(found["started_at"], resolved_at)
    cur = await conn.execute(f"UPDATE status_incidents SET resolved_at = %s WHERE id = %s RETURNING {_COLUMNS}",
                             (resolved_at, incident_id))
    row = one(await cur.fetchone())
    await accounts.record_async(conn, tenant_id, actor, "incident.resolved", incident=incident_id)
    return to_json(row)
