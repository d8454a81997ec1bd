"""Monthly spend limits per tenant and per API key, checked when a request is admitted.

A budget is spent when month-to-date spend (the ledger, via its daily rollup) plus the estimated
cost of the caller's queued and running requests reaches the limit. Counting what is in flight
bounds the overshoot: a request is admitted only while committed spend is under the limit, so the
most a month can exceed it by is the cost of the requests admitted in that last moment (each at
most `max_tokens_per_request` tokens, at most `max_inflight_requests` of them). Months are UTC
calendar months; a budget of 0 stops all paid work.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg.rows import DictRow, dict_row

from billing import price_book
from billing.pricing import Price, context_percent, inflight_cost, usd
from core.errors import BudgetExceeded

_MONTH_START = "(date_trunc('month', now() AT TIME ZONE 'UTC'))::date"


def _month_to_date_sql(tenant: str) -> str:
    """A scalar subquery: the spend this UTC month of the tenant `tenant` names (SQL)."""
    return ("(SELECT COALESCE(sum(d.cost_micro_usd), 0)::bigint FROM usage_daily d "
            f"WHERE d.tenant_id = {tenant} AND d.day >= {_MONTH_START})")


# The spend of the tenant `t` of an enclosing query (the key lookup reads it in the same
# statement, for the spend header).
MONTH_TO_DATE_OF_T = _month_to_date_sql("t.id")


@dataclass(frozen=True)
class BudgetState:
    """One budget and where the month stands against it (all micro-USD)."""

    scope: str  # "tenant" or "key"
    limit_micro_usd: int
    spent_micro_usd: int
    inflight_micro_usd: int
    api_key_id: str | None = None
    api_key_prefix: str | None = None

    @property
    def committed_micro_usd(self) -> int:
        return self.spent_micro_usd + self.inflight_micro_usd

    @property
    def remaining_micro_usd(self) -> int:
        return max(0, self.limit_micro_usd - self.committed_micro_usd)

    @property
    def exhausted(self) -> bool:
        return self.committed_micro_usd >= self.limit_micro_usd


def first_exhausted(states: list[BudgetState]) -> BudgetState | None:
    """The budget that refuses new paid work, if any; the tenant's is named before a key's."""
    for state in sorted(states, key=lambda s: s.scope != "tenant"):
        if state.exhausted:
            return state
    return None


def refusal(state: BudgetState, tenant_name: str, month: str) -> BudgetExceeded:
    """The 402: which budget, the spend, and how to raise it."""
    if state.scope == "tenant":
        what = f"the monthly budget of tenant {tenant_name!r}"
        how = f"quilt budgets set {tenant_name} --usd <amount>"
        field = "budget.tenant"
    else:
        what = f"the monthly budget of API key {state.api_key_prefix}..."
        how = f"quilt budgets set {tenant_name} --key {state.api_key_prefix} --usd <amount>"
        field = "budget.api_key"
    return BudgetExceeded(
        f"{what} is used up for {month}: ${usd(state.spent_micro_usd)} spent plus "
        f"${usd(state.inflight_micro_usd)} in flight of ${usd(state.limit_micro_usd)}. "
        f"Raise it on the dashboard's account page, with PUT /api/v1/quilt/budgets, or (an operator) with "
        f"`{how}`; it resets on the 1st of next month (UTC).",
        field=field,
    )


# ------------------------------------------------------------------------------------ API side (async)

_BUDGETS = """
SELECT b.api_key_id, k.prefix, b.monthly_limit_micro_usd,
       to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM') AS month
FROM budgets b LEFT JOIN api_keys k ON k.id = b.api_key_id
WHERE b.tenant_id = %(tenant)s AND (b.api_key_id IS NULL OR b.api_key_id = %(key)s OR %(all_keys)s)
"""

_SPENT = f"""
SELECT api_key_id, sum(cost_micro_usd)::bigint AS spent FROM usage_daily
WHERE tenant_id = %s AND day >= {_MONTH_START}
GROUP BY api_key_id
"""

_INFLIGHT = """
SELECT r.kind, r.api_key_id, r.n_tokens, tm.base_model, tm.context_length
FROM requests r LEFT JOIN training_models tm ON tm.id = r.model_id
WHERE r.tenant_id = %s AND r.status IN ('queued', 'running') AND r.n_tokens > 0
"""


def _states(budgets: list[dict], spent_rows: list[dict], inflight_rows: list[dict],
            prices: dict[str, Price], served: list[str] | None = None) -> list[BudgetState]:
    """Pure: budgets, month-to-date spend per key, in-flight requests and current prices -> states.

    A request whose base model is unknown here (e.g. sampling, whose `model_id` is a sampler) is
    priced at the highest rate of any served model (of the whole book if none is priced)."""
    spent_by_key = {r["api_key_id"]: int(r["spent"]) for r in spent_rows}
    served_prices = [prices[m] for m in served or () if m in prices] or list(prices.values())
    fallback = max((p.max_rate for p in served_prices), default=0)
    inflight_by_key: dict[str | None, int] = {}
    for r in inflight_rows:
        price = prices.get(r["base_model"] or "")
        percent = context_percent(r.get("context_length"), price.context_tiers) if price is not None else 100
        cost = inflight_cost(r["kind"], r["n_tokens"], price, fallback, percent)
        inflight_by_key[r["api_key_id"]] = inflight_by_key.get(r["api_key_id"], 0) + cost
    out = []
    for b in budgets:
        key = b["api_key_id"]
        if key is None:
            spent, inflight = sum(spent_by_key.values()), sum(inflight_by_key.values())
        else:
            spent, inflight = spent_by_key.get(key, 0), inflight_by_key.get(key, 0)
        out.append(BudgetState("tenant" if key is None else "key", int(b["monthly_limit_micro_usd"]), spent,
                               inflight, key, b["prefix"]))
    return out


async def budget_states(conn, tenant_id: str, key_id: str | None, *, all_keys: bool = False) -> tuple[list[BudgetState], str]:
    """The tenant's budget and the calling key's (or every key's), with month-to-date spend and the
    in-flight estimate; also the month label ('2026-07'). One query when there are no budgets."""
    cur = await conn.execute(_BUDGETS, {"tenant": tenant_id, "key": key_id, "all_keys": all_keys})
    budgets = await cur.fetchall()
    if not budgets:
        return [], ""
    month = budgets[0]["month"]
    cur = await conn.execute(_SPENT, (tenant_id,))
    spent_rows = await cur.fetchall()
    cur = await conn.execute(_INFLIGHT, (tenant_id,))
    inflight_rows = await cur.fetchall()
    prices = await price_book.current_prices(conn)
    cur = await conn.execute("SELECT name FROM base_models")
    served = [r["name"] for r in await cur.fetchall()]
    return _states(budgets, spent_rows, inflight_rows, prices, served), month


async def check(conn, *, tenant_id: str, tenant_name: str, key_id: str | None) -> None:
    """Raise BudgetExceeded (402) if the tenant's or this key's monthly budget is used up."""
    states, month = await budget_states(conn, tenant_id, key_id)
    state = first_exhausted(states)
    if state is not None:
        raise refusal(state, tenant_name, month)


async def month_to_date(conn, tenant_id: str) -> int:
    """The tenant's spend this UTC month, in micro-USD (ledger only, not in flight)."""
    cur = await conn.execute(f"SELECT {_month_to_date_sql('%s')} AS spent", (tenant_id,))
    return int((await cur.fetchone())["spent"])


# ------------------------------------------------------------------------------- operator side (sync)


_SET = ("INSERT INTO budgets (tenant_id, api_key_id, monthly_limit_micro_usd) VALUES (%s, %s, %s) "
        "ON CONFLICT (tenant_id, api_key_id) DO UPDATE SET "
        "monthly_limit_micro_usd = EXCLUDED.monthly_limit_micro_usd, updated_at = now()")
_CLEAR = "DELETE FROM budgets WHERE tenant_id = %s AND api_key_id IS NOT DISTINCT FROM %s"


def set_budget(conn: psycopg.Connection[DictRow], tenant_id: str, limit_micro_usd: int, api_key_id: str | None = None) -> None:
    """Set (or replace) the monthly limit of a tenant, or of one of its keys."""
    conn.execute(_SET, (tenant_id, api_key_id, limit_micro_usd))


def clear_budget(conn: psycopg.Connection[DictRow], tenant_id: str, api_key_id: str | None = None) -> bool:
    """Remove a limit; True if there was one."""
    return conn.execute(_CLEAR, (tenant_id, api_key_id)).rowcount > 0


async def set_budget_async(conn, tenant_id: str, limit_micro_usd: int, api_key_id: str | None = None) -> None:
    """Async form of `set_budget` (PUT /api/v1/quilt/budgets)."""
    await conn.execute(_SET, (tenant_id, api_key_id, limit_micro_usd))


async def clear_budget_async(conn, tenant_id: str, api_key_id: str | None = None) -> bool:
    """Async form of `clear_budget`."""
    return (await conn.execute(_CLEAR, (tenant_id, api_key_id))).rowcount > 0


async def budget_limit_async(conn, tenant_id: str, api_key_id: str | None = None) -> int | None:
    """The monthly limit of a tenant or one of its keys, in micro-USD (None: no limit)."""
    row = await (await conn.execute("SELECT monthly_limit_micro_usd AS m FROM budgets WHERE tenant_id = %s "
                                    "AND api_key_id IS NOT DISTINCT FROM %s", (tenant_id, api_key_id))).fetchone()
    return None if row is None else row["m"]


def list_budgets_sync(conn: psycopg.Connection[DictRow], tenant_id: str) -> list[dict]:
    """[{api_key_id, prefix, monthly_limit_micro_usd, spent_micro_usd}] for this UTC month."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(
            f"""SELECT b.api_key_id, k.prefix, b.monthly_limit_micro_usd,
                       (SELECT COALESCE(sum(d.cost_micro_usd), 0)::bigint FROM usage_daily d
                        WHERE d.tenant_id = b.tenant_id AND d.day >= {_MONTH_START}
                          AND (b.api_key_id IS NULL OR d.api_key_id = b.api_key_id)) AS spent_micro_usd
                FROM budgets b LEFT JOIN api_keys k ON k.id = b.api_key_id
                WHERE b.tenant_id = %s ORDER BY b.api_key_id NULLS FIRST""",
            (tenant_id,),
        ).fetchall()
