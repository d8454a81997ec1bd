"""Billing routes: usage (spend by day, model and unit), the price book, cost estimates.

Amounts are given twice: exact integer micro-USD (`*_micro_usd`) and exact decimal USD text
(`*_usd`, six places).
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from api.deps import Pool, Who
from api.input_guard import GuardedRoute
from billing import budgets, price_book, usage
from billing.budgets import BudgetState
from billing.pricing import UNITS, Price, Units, estimate, usd
from core.errors import InvalidInput, NotFound
from tenancy import scoped

router = APIRouter(route_class=GuardedRoute, prefix="/quilt", tags=["billing"])

MAX_REPORT_DAYS = 366
ROUNDING = ("per request and per unit: round_half_up(tokens x rate / 1e6) micro-USD; "
            "a request's cost is the sum of its unit costs")


class TokensPerStep(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prefill: int = Field(0, ge=0, le=10**12, description="prompt / forward-only tokens per step")
    sample: int = Field(0, ge=0, le=10**12, description="generated tokens per step")
    train: int = Field(0, ge=0, le=10**12, description="forward_backward model-input tokens per step")


class EstimateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    base_model: str = Field(max_length=256)
    steps: int = Field(1, ge=1, le=10_000_000)
    tokens_per_step: TokensPerStep


def price_json(p: Price, current: bool | None = None) -> dict:
    out: dict[str, Any] = {"base_model": p.base_model, "effective_from": p.effective_from.isoformat(), "note": p.note}
    if current is not None:
        out["current"] = current
    for u in UNITS:
        out[f"{u}_micro_usd_per_mtok"] = p.rate(u)
        out[f"{u}_usd_per_mtok"] = usd(p.rate(u))
    out["storage_micro_usd_per_gb_month"] = p.storage_micro_usd_per_gb_month
    out["storage_usd_per_gb_month"] = usd(p.storage_micro_usd_per_gb_month)
    return out


def budget_json(s: BudgetState) -> dict:
    return {
        "scope": s.scope, "api_key_prefix": s.api_key_prefix,
        "monthly_limit_micro_usd": s.limit_micro_usd, "monthly_limit_usd": usd(s.limit_micro_usd),
        "spent_micro_usd": s.spent_micro_usd, "spent_usd": usd(s.spent_micro_usd),
        "in_flight_micro_usd": s.inflight_micro_usd, "in_flight_usd": usd(s.inflight_micro_usd),
        "remaining_micro_usd": s.remaining_micro_usd, "remaining_usd": usd(s.remaining_micro_usd),
        "exhausted": s.exhausted,
    }


@router.get("/usage")
async def get_usage(who: Who, pool: Pool, since: date | None = None, until: date | None = None) -> dict:
    """Spend between `since` (default: the 1st of this UTC month) and `until` (exclusive; default:
    tomorrow), by day, by base model and by unit, plus this month's budgets and the bytes of live
    checkpoints beside their quota (`max_checkpoint_bytes`: saves are refused once they are reached)."""
    today = datetime.now(UTC).date()
    since = since or today.replace(day=1)
    until = until or today + timedelta(days=1)
    if until <= since:
        raise InvalidInput(f"until ({until}) must be after since ({since})", field="until")
    if (until - since).days > MAX_REPORT_DAYS:
        raise InvalidInput(f"a report spans at most {MAX_REPORT_DAYS} days", field="since")
    async with pool.connection() as conn:
        summary = await usage.report(conn, who.tenant_id, since, until)
        states, month = await budgets.budget_states(conn, who.tenant_id, who.key_id, all_keys=True)
        month_to_date = await budgets.month_to_date(conn, who.tenant_id)
        stored = await scoped.checkpoint_bytes(conn, who)
    return {
        "tenant_id": who.tenant_id,
        "tenant_name": who.tenant_name,
        **summary.to_json(),
        "month_to_date_micro_usd": month_to_date,
        "month_to_date_usd": usd(month_to_date),
        "budgets": [budget_json(s) for s in states],
        "budget_month": month or today.strftime("%Y-%m"),
        "checkpoint_bytes": stored,
        "max_checkpoint_bytes": who.max_checkpoint_bytes,
    }


@router.get("/prices")
async def get_prices(who: Who, pool: Pool) -> dict:
    """The price book: every entry, with the one in force now marked `current`."""
    async with pool.connection() as conn:
        entries = await price_book.list_prices(conn)
        current = await price_book.current_prices(conn)
    current_ids = {p.id for p in current.values()}
    return {"unit": "per million tokens", "rounding": ROUNDING,
            "prices": [price_json(p, p.id in current_ids) for p in entries]}


@router.post("/estimate")
async def post_estimate(body: EstimateRequest, who: Who, pool: Pool) -> dict:
    """Expected cost of a planned run: tokens per step by unit, times steps, at today's prices;
    and whether it fits in what is left of the caller's monthly budgets."""
    async with pool.connection() as conn:
        prices = await price_book.current_prices(conn)
        price = prices.get(body.base_model)
        if price is None:
            raise NotFound(f"no price for base_model {body.base_model!r}; priced models: {sorted(prices)}",
                           field="base_model")
        states, _ = await budgets.budget_states(conn, who.tenant_id, who.key_id)
    per_step = Units(body.tokens_per_step.prefill, body.tokens_per_step.sample, body.tokens_per_step.train)
    cost = estimate(per_step, body.steps, price)
    total = cost.total_micro_usd
    remaining = min((s.remaining_micro_usd for s in states), default=None)
    return {
        "base_model": body.base_model,
        "steps": body.steps,
        "price": price_json(price),
        "by_unit": [{"unit": u, "tokens": per_step.of(u) * body.steps, "cost_micro_usd": cost.of(u),
                     "cost_usd": usd(cost.of(u))} for u in UNITS],
        "cost_micro_usd": total,
        "cost_usd": usd(total),
        "per_step_usd": usd(estimate(per_step, 1, price).total_micro_usd),
        "budget_remaining_micro_usd": remaining,
        "budget_remaining_usd": None if remaining is None else usd(remaining),
        "fits_budget": None if remaining is None else total <= remaining,
        "rounding": ROUNDING,
    }
