"""Credit grants (prepaid or promotional) and what is left of them.

A grant is consumed by the tenant's usage from the day it is granted on (UTC days, the ledger's
daily rollup), oldest grant first; usage beyond the balance is what gets charged. `apply` is the
whole rule, a pure function over plain data; `credit_state` feeds it from Postgres. Grants are
append-only rows (migration 0011), made by an operator (`quilt credits grant`, or the operator
API), each with its audit row (tenancy.accounts), written here in the same transaction.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date

import psycopg
from psycopg.rows import DictRow

from core import db
from tenancy import accounts

MAX_GRANT_MICRO_USD = 10**9 * 10**6  # a billion USD: past any real grant, far inside bigint


@dataclass(frozen=True)
class CreditState:
    granted_micro_usd: int  # all grants
    applied_micro_usd: int  # usage they paid for
    charged_micro_usd: int  # usage since the first grant that they did not cover

    @property
    def balance_micro_usd(self) -> int:
        return self.granted_micro_usd - self.applied_micro_usd


def apply(grants: list[tuple[date, int]], usage: list[tuple[date, int]]) -> CreditState:
    """Grants `(day, amount)` against daily usage `(day, cost)`: a day's grants are available to
    that day's usage; usage before the first grant is outside this account (charged as usual)."""
    events = sorted([(d, 0, amount) for d, amount in grants] + [(d, 1, cost) for d, cost in usage])
    balance = granted = applied = charged = 0
    for _day, is_usage, amount in events:
        if not is_usage:
            balance += amount
            granted += amount
        elif granted:
            covered = min(balance, amount)
            balance -= covered
            applied += covered
            charged += amount - covered
    return CreditState(granted, applied, charged)


_GRANTS = "SELECT (created_at AT TIME ZONE 'UTC')::date AS day, amount_micro_usd FROM credit_grants WHERE tenant_id = %s"
_USAGE = ("SELECT day, sum(cost_micro_usd)::bigint AS cost FROM usage_daily WHERE tenant_id = %s AND day >= "
          "(SELECT min((created_at AT TIME ZONE 'UTC')::date) FROM credit_grants WHERE tenant_id = %s) GROUP BY day")
_LIST = ("SELECT id, amount_micro_usd, category, reason, granted_by, created_at FROM credit_grants "
         "WHERE tenant_id = %s ORDER BY id DESC")
_GRANT = ("INSERT INTO credit_grants (tenant_id, amount_micro_usd, category, reason, granted_by) "
          "VALUES (%s, %s, %s, %s, %s) RETURNING id")


async def credit_state(conn: psycopg.AsyncConnection[DictRow], tenant_id: str) -> tuple[CreditState, list[dict]]:
    """The tenant's credit state and its grants, newest first."""
    grants = [(r["day"], r["amount_micro_usd"]) for r in await (await conn.execute(_GRANTS, (tenant_id,))).fetchall()]
    usage = [(r["day"], r["cost"]) for r in await (await conn.execute(_USAGE, (tenant_id, tenant_id))).fetchall()]
    listed = await (await conn.execute(_LIST, (tenant_id,))).fetchall()
    return apply(grants, usage), listed


def check_grant(amount_micro_usd: int, category: str, reason: str) -> None:
    """Raise ValueError naming the field when a grant cannot be made."""
    if not 0 < amount_micro_usd <= MAX_GRANT_MICRO_USD:
        raise ValueError(f"usd: a grant must be more than 0 and at most 1,000,000,000 USD, got {amount_micro_usd / 1e6}")
    if category not in ("paid", "promotional"):
        raise ValueError(f"category: must be 'paid' or 'promotional', got {category!r}")
    if not reason.strip() or len(reason) > 500:
        raise ValueError("reason: say why the credit is granted (1 to 500 characters)")


def grant(conn: psycopg.Connection[DictRow], tenant_id: str, amount_micro_usd: int, category: str, reason: str,
          actor: str) -> int:
    """Grant credit (the CLI) and record it in the audit log, in the caller's transaction; returns
    the grant's id."""
    check_grant(amount_micro_usd, category, reason)
    grant_id = db.one(conn.execute(_GRANT, (tenant_id, amount_micro_usd, category, reason, actor)).fetchone())["id"]
    accounts.record(conn, tenant_id, actor, "credit.granted", **_detail(grant_id, amount_micro_usd, category, reason))
    return grant_id


async def grant_async(conn: psycopg.AsyncConnection[DictRow], tenant_id: str, amount_micro_usd: int, category: str,
                      reason: str, actor: str) -> int:
    """Async form of `grant` (the operator API)."""
    check_grant(amount_micro_usd, category, reason)
    cur = await conn.execute(_GRANT, (tenant_id, amount_micro_usd, category, reason, actor))
    grant_id = db.one(await cur.fetchone())["id"]
    await accounts.record_async(conn, tenant_id, actor, "credit.granted",
                                **_detail(grant_id, amount_micro_usd, category, reason))
    return grant_id


def _detail(grant_id: int, amount_micro_usd: int, category: str, reason: str) -> dict:
    return {"grant_id": grant_id, "amount_micro_usd": amount_micro_usd, "category": category, "reason": reason}


_UNSENT = ("SELECT g.id, g.amount_micro_usd, g.category, g.reason, b.stripe_customer_id FROM credit_grants g "
           "JOIN billing_accounts b ON b.tenant_id = g.tenant_id "
           "WHERE NOT EXISTS (SELECT 1 FROM credit_grant_stripe s WHERE s.grant_id = g.id) ORDER BY g.id")


def send_to_stripe(conn: psycopg.Connection[DictRow], gateway) -> int:
    """Send grants Stripe has not got yet as Billing credit grants (whole cents, rounded down: Stripe
    never applies more than was granted); returns how many went. Part of the Stripe sync."""
    sent = 0
    for g in conn.execute(_UNSENT).fetchall():
        cents = g["amount_micro_usd"] // 10_000
        if cents <= 0:
            continue
        stripe_id = gateway.create_credit_grant(grant_id=g["id"], customer_id=g["stripe_customer_id"],
                                                amount_cents=cents, category=g["category"], name=g["reason"])
        conn.execute("INSERT INTO credit_grant_stripe (grant_id, stripe_credit_grant_id) VALUES (%s, %s) "
                     "ON CONFLICT DO NOTHING", (g["id"], stripe_id))
        sent += 1
    return sent
