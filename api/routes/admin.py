"""What the tinker SDK's AdminClient reads (and `tinker billing` prints): a tenant's hourly usage
with its cost, its checkpoint storage, and its audit log.

Each answers for the caller's own tenant, operators included (an operator reads every tenant's
audit log through `/api/v1/quilt/audit`). Storage is attributed to the project of the session that holds it.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Literal

from fastapi import APIRouter, Query

from api.deps import Pool, Who
from api.input_guard import GuardedRoute
from api.routes.runs import metadata_text
from billing import storage, usage
from billing.pricing import BYTES_PER_GB, MICRO_PER_USD
from core import ids
from tenancy import accounts, scoped

router = APIRouter(route_class=GuardedRoute, tags=["admin"])

AUDIT_ENTRIES = 1000
# tinker's audit categories as the resources of Quilt's audit actions (`budget` of `budget.set`).
# `checkpoints`: publishing, copies and weights access tokens; `projects`: projects made.
RESOURCES_OF_EVENT_TYPE = {"all": None, "checkpoints": ["checkpoint"], "projects": ["project"],
                           "teams": ["member"],
                           "organizations": ["tenant", "key", "budget", "credit", "card", "invoice"]}


def _key_urn(prefix: str | None) -> str | None:
    return f"key:{prefix}" if prefix else None


@router.get("/billing/usage/events")
async def billing_usage_events(who: Who, pool: Pool, starting_on: datetime, ending_before: datetime) -> dict:
    """Your usage in one-hour UTC buckets from `starting_on` to `ending_before` (on UTC hours, at
    most 14 days apart): per base model, session and API key, training, prefill and sampled tokens
    with what they cost, read from the ledger the invoice is made from (before credits). Prefill
    covers sampling prompts and `forward` passes, both billed at the prefill rate."""
    now = datetime.now(UTC)
    start, end = usage.event_window(starting_on, ending_before, now)
    async with pool.connection() as conn:
        events, sessions = await usage.usage_events(conn, who.tenant_id, start, end)
    for event in events:
        event["user_id"] = _key_urn(event.pop("key_prefix"))
    return {"data": events, "sessions": {sid: {"user_metadata": metadata_text(meta) or None}
                                         for sid, meta in sessions.items()},
            # Every ledger row is priced when it is written: no cost here is revised later.
            "cost_data_through": min(end, now)}


@router.get("/billing/usage/checkpoints/current")
async def checkpoint_storage(who: Who, pool: Pool, project_id: str | None = Query(None, max_length=128)) -> dict:
    """Your live checkpoints (of one of your projects, given `project_id`), counted and sized by
    project and by the API key whose session made them, with the storage rate in force (USD per
    GB-month of 720 hours; each base's rate, weighted by bytes) and what a month of them costs at it.
    Storage is billed hourly onto the ledger (billing.storage)."""
    async with pool.connection() as conn:
        if project_id is not None:
            await scoped.get_project(conn, who, project_id)
        rows = await scoped.checkpoint_storage(conn, who, project_id=project_id)
        rate = await storage.tenant_rate_micro_usd_per_gb_month(conn, who.tenant_id) / MICRO_PER_USD
    return {"effective_rate_usd_per_gigabyte_month": rate,
            "data": [{"project_id": r["project_id"], "org_user_urn": _key_urn(r["key_prefix"]), "user_email": None,
                      "user_name": r["key_name"] or None, "checkpoint_count": r["checkpoints"],
                      "size_bytes": r["size_bytes"], "size_gigabytes": r["size_bytes"] / BYTES_PER_GB,
                      "estimated_monthly_cost_usd": r["size_bytes"] / BYTES_PER_GB * rate} for r in rows]}


@router.get("/audit")
async def audit_log(who: Who, pool: Pool,
                    event_type: Literal["all", "checkpoints", "projects", "teams", "organizations"] = "all",
                    day: date | None = None) -> dict:
    """Your tenant's audit log, oldest first: the newest 1,000 entries of UTC `day`, or of all time
    without it. `event` is the action with `_` for `.` (`budget_set`); `event_details` holds its
    detail and the `actor` (`key:<prefix>` or `account:<email>`). `teams` are member changes;
    `organizations` are tenant, key, budget, credit and payment changes."""
    since = None if day is None else datetime(day.year, day.month, day.day, tzinfo=UTC)
    until = None if since is None or day == date.max else since + timedelta(days=1)
    async with pool.connection() as conn:
        rows = await accounts.audit_rows(conn, who.tenant_id, limit=AUDIT_ENTRIES, since=since, until=until,
                                         resources=RESOURCES_OF_EVENT_TYPE[event_type])
    return {"entries": [audit_entry(r["at"], r["action"], r["detail"], r["actor"]) for r in reversed(rows)]}


def audit_entry(at: datetime, action: str, detail: dict, actor: str) -> dict:
    """One audit row as tinker's AuditLogEntry: `event` is the action with `_` for `.`,
    `event_details` its detail and actor. A checkpoint event also carries the checkpoint it is about
    (a copy's source) as the top-level `tinker_path` and `model_id`, which the SDK marks deprecated
    but still reads (the cookbook's save_audit_log writes them and nothing of `event_details`)."""
    entry: dict = {"timestamp": at, "event": action.replace(".", "_"), "event_details": {**detail, "actor": actor}}
    path = (detail.get("tinker_path") or detail.get("source")) if action.startswith("checkpoint.") else None
    try:
        run, _, _ = ids.parse_tinker_path(path) if isinstance(path, str) else ("", "", "")
    except ValueError:
        run = ""
    if run:
        entry |= {"tinker_path": path, "model_id": run}
    return entry
