"""Account routes under /api/v1/quilt: budgets a tenant sets itself, its credit and audit trail,
and the operator's suspension and credit grants.

Amounts are given as exact decimal USD text (`"12.50"`) and echoed as micro-USD too. Every change
writes an audit row in the same transaction (tenancy.accounts), naming who made it (the caller's key
or member account).
Operator routes answer 403 to any other caller; a tenant a caller may not see is a 404.
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field

from api.caller_cache import changing
from api.deps import Callers, Pool, Who
from api.input_guard import GuardedRoute
from api.routes.billing import budget_json
from billing import budgets, credits
from billing.pricing import parse_usd, usd
from core.errors import Forbidden, InvalidInput, NotFound
from tenancy import accounts, roles, scoped, tenants
from tenancy.auth import Principal

router = APIRouter(route_class=GuardedRoute, prefix="/quilt", tags=["account"])

MAX_BUDGET_USD = 10**9  # a billion a month: past any real budget, far inside the bigint column


class BudgetRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    monthly_usd: str | None = Field(..., max_length=32,
                                    description='the monthly limit in USD ("250", "12.50"); null removes it')
    api_key_prefix: str | None = Field(None, max_length=64,
                                       description="limit one of your keys (its prefix, as keys list shows it); "
                                                   "absent: the whole tenant")


class SuspendRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str = Field(min_length=1, max_length=500, description="shown to the tenant with every refusal")
    kind: Literal["operator", "payment"] = "operator"


class PlanRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens_per_minute: int | None = Field(None, ge=1, le=2**31 - 1)
    max_inflight_requests: int | None = Field(None, ge=1, le=2**31 - 1)
    max_models: int | None = Field(None, ge=1, le=2**31 - 1)
    max_checkpoint_bytes: int | None = Field(None, ge=1, le=2**63 - 1,
                                             description="bytes of live checkpoints the tenant may keep")
    plan_weight: float | None = Field(None, gt=0, le=1000, allow_inf_nan=False,
                                      description="the tenant's fair-share weight in the trainer (re-read every 30 s)")


class CreditGrantRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    usd: str = Field(max_length=32, description='the amount in USD ("100", "25.50")')
    category: Literal["paid", "promotional"] = "promotional"
    reason: str = Field(min_length=1, max_length=500)


def _micro_usd(text: str, field: str, *, most: int) -> int:
    try:
        amount = parse_usd(text)
    except ValueError as exc:
        raise InvalidInput(f"{field}: {exc}", field=field) from None
    if amount > most * 10**6:
        raise InvalidInput(f"{field}: at most {most:,} USD, got {text}", field=field)
    return amount


def _operator(who: Principal) -> None:
    if not who.is_operator:
        raise Forbidden("only an operator may do this", field="X-API-Key")


async def _tenant_id(conn, name: str) -> str:
    tenant_id = await tenants.tenant_id_named(conn, name)
    if tenant_id is None:
        raise NotFound(f"no tenant named {name!r}", field="tenant")
    return tenant_id


async def _budgets(conn, who: Principal) -> dict:
    states, month = await budgets.budget_states(conn, who.tenant_id, None, all_keys=True)
    return {"month": month, "budgets": [budget_json(s) for s in states]}


@router.get("/budgets")
async def get_budgets(who: Who, pool: Pool) -> dict:
    """Your tenant's monthly budgets (the tenant's and each key's) and where this month stands."""
    async with pool.connection() as conn:
        return await _budgets(conn, who)


@router.put("/budgets")
async def put_budget(body: BudgetRequest, who: Who, pool: Pool) -> dict:
    """Set or remove a monthly budget of your tenant, or of one of its keys. Admission refuses new
    billable work with 402 naming the budget once it is used up."""
    async with pool.connection() as conn:
        await change_budget(conn, who, body.monthly_usd, body.api_key_prefix)
        await conn.commit()
        return await _budgets(conn, who)


async def change_budget(conn, who: Principal, monthly_usd: str | None, api_key_prefix: str | None) -> None:
    """Set (or with None, clear) one budget of the caller's tenant, and record it (the API and the
    dashboard's account page). Owners change any; a key may lower its own (tenancy.roles)."""
    limit = None if monthly_usd is None else _micro_usd(monthly_usd, "monthly_usd", most=MAX_BUDGET_USD)
    key_id = None
    if api_key_prefix is not None:
        key_id = await scoped.key_id(conn, who, api_key_prefix.removesuffix("..."))
    own_key = key_id is not None and key_id == who.key_id
    current = await budgets.budget_limit_async(conn, who.tenant_id, key_id) if own_key else None
    if why := roles.budget_refusal(who.member_role, own_key, current, limit):
        raise Forbidden(why, field="role" if not own_key else "monthly_usd")
    actor = who.actor
    scope = {"api_key_prefix": api_key_prefix} if key_id else {}
    if limit is None:
        if await budgets.clear_budget_async(conn, who.tenant_id, key_id):
            await accounts.record_async(conn, who.tenant_id, actor, "budget.cleared", **scope)
    else:
        await budgets.set_budget_async(conn, who.tenant_id, limit, key_id)
        await accounts.record_async(conn, who.tenant_id, actor, "budget.set", monthly_micro_usd=limit, **scope)


@router.get("/credits")
async def get_credits(who: Who, pool: Pool) -> dict:
    """Your credit grants, what they have paid for, and the balance left."""
    async with pool.connection() as conn:
        return await credits_json(conn, who.tenant_id)


async def credits_json(conn, tenant_id: str) -> dict:
    state, grants = await credits.credit_state(conn, tenant_id)
    return {"granted_usd": usd(state.granted_micro_usd), "applied_usd": usd(state.applied_micro_usd),
            "balance_usd": usd(state.balance_micro_usd), "charged_since_first_grant_usd": usd(state.charged_micro_usd),
            "balance_micro_usd": state.balance_micro_usd,
            "grants": [{"id": g["id"], "usd": usd(g["amount_micro_usd"]), "category": g["category"],
                        "reason": g["reason"], "granted_by": g["granted_by"],
                        "created_at": g["created_at"].isoformat()} for g in grants]}


@router.get("/audit")
async def get_audit(who: Who, pool: Pool, limit: int = Query(50, ge=1, le=500),
                    before: int | None = Query(None, ge=1, le=2**63 - 1),
                    tenant: str | None = Query(None, max_length=128)) -> dict:
    """Who did what, newest first: your tenant's rows; an operator's, every tenant's (or `tenant`'s).
    Page with `before` = the last row's id."""
    async with pool.connection() as conn:
        return await audit_json(conn, who, tenant, limit=limit, before=before)


async def audit_json(conn, who: Principal, tenant: str | None, *, limit: int, before: int | None = None) -> dict:
    if who.is_operator:
        scope = await _tenant_id(conn, tenant) if tenant else None
    elif tenant is not None:
        raise Forbidden("only an operator may read another tenant's audit log", field="tenant")
    else:
        scope = who.tenant_id
    rows = await accounts.audit_rows(conn, scope, limit=limit, before=before)
    return {"entries": [{"id": r["id"], "tenant": r["tenant_name"], "actor": r["actor"], "action": r["action"],
                         "detail": r["detail"], "at": r["at"].isoformat()} for r in rows],
            "next_before": rows[-1]["id"] if len(rows) == limit else None}


@router.post("/tenants/{name}/suspend")
async def suspend_tenant(name: str, body: SuspendRequest, who: Who, pool: Pool, callers: Callers) -> dict:
    """(Operators.) Refuse a tenant's new billable work with `reason` until restored; nothing is deleted."""
    async with changing(pool, callers) as conn:
        await suspend(conn, who, name, body.kind, body.reason)
    return {"tenant": name, "suspended": True, "kind": body.kind, "reason": body.reason}


async def suspend(conn, who: Principal, name: str, kind: accounts.SuspensionKind, reason: str) -> None:
    _operator(who)
    await accounts.suspend_async(conn, await _tenant_id(conn, name), kind, reason,
                                 who.actor)


@router.post("/tenants/{name}/restore")
async def restore_tenant(name: str, who: Who, pool: Pool, callers: Callers) -> dict:
    """(Operators.) Lift a suspension; service resumes from the tenant's next call."""
    async with changing(pool, callers) as conn:
        lifted = await restore(conn, who, name)
    return {"tenant": name, "suspended": False, "was_suspended": lifted}


async def restore(conn, who: Principal, name: str) -> bool:
    _operator(who)
    return await accounts.restore_async(conn, await _tenant_id(conn, name), who.actor)


@router.post("/tenants/{name}/credits")
async def grant_credit(name: str, body: CreditGrantRequest, who: Who, pool: Pool) -> dict:
    """(Operators.) Grant a tenant prepaid or promotional credit, used by its usage from today on."""
    async with pool.connection() as conn:
        grant_id, amount = await grant(conn, who, name, body.usd, body.category, body.reason)
    return {"tenant": name, "grant_id": grant_id, "usd": usd(amount)}


async def grant(conn, who: Principal, name: str, amount_usd: str, category: str, reason: str) -> tuple[int, int]:
    """(grant id, micro-USD) of a new credit grant, recorded in the audit log."""
    _operator(who)
    amount = _micro_usd(amount_usd, "usd", most=credits.MAX_GRANT_MICRO_USD // 10**6)
    if amount == 0:
        raise InvalidInput("usd: a grant must be more than 0", field="usd")
    grant_id = await credits.grant_async(conn, await _tenant_id(conn, name), amount, category, reason, who.actor)
    return grant_id, amount


@router.put("/tenants/{name}/plan")
async def put_plan(name: str, body: PlanRequest, who: Who, pool: Pool, callers: Callers) -> dict:
    """(Operators.) A tenant's quotas and fair-share weight (the fields given); they apply from its next call."""
    async with changing(pool, callers) as conn:
        plan = await set_plan(conn, who, name, body.model_dump(exclude_none=True))
    return plan


async def set_plan(conn, who: Principal, name: str, changes: dict) -> dict:
    _operator(who)
    tenant_id = await _tenant_id(conn, name)
    row = await tenants.set_plan_async(conn, tenant_id, changes)
    await accounts.record_async(conn, tenant_id, who.actor, "tenant.plan_set",
                                **changes)
    return {"tenant": name, **{k: row[k] for k in tenants.PLAN_FIELDS}}
