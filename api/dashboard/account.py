"""The dashboard's account pages: a tenant's budgets (editable), credit and audit trail, its card
and invoices (Stripe), and the operator's tenants page (suspend, restore, plan and quotas, credit grants). Each form calls the
same function as its API route (api.routes.account), so both check and record alike."""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import urlsplit

import stripe
from fastapi import APIRouter, Form, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import RedirectResponse

from api import links
from api.caller_cache import changing
from api.dashboard.deps import (
    Changing,
    LoggedIn,
    OperatorChanging,
    OperatorOnly,
    OwnerChanging,
    page_context,
)
from api.dashboard.render import PageRoute, csp_with_form_action, page
from api.deps import Callers, Pool
from api.routes import account
from billing import budgets
from billing.stripe_api import StripeGateway
from core.errors import InvalidInput, NotFound
from core.settings import get_billing_settings
from tenancy import keys, scoped

router = APIRouter(prefix="/dashboard", route_class=PageRoute, include_in_schema=False)


@router.get("/account")
async def account_page(request: Request, viewer: LoggedIn, pool: Pool, saved: str | None = Query(None, max_length=40)):
    """Your tenant: suspension (if any), budgets with a form to change them, credit, and who did what."""
    async with pool.connection() as conn:
        states, month = await budgets.budget_states(conn, viewer.who.tenant_id, None, all_keys=True)
        credit = await account.credits_json(conn, viewer.who.tenant_id)
        audit = await account.audit_json(conn, viewer.who, None, limit=50)
        key_rows = [k for k in await keys.list_keys_async(conn, viewer.who.tenant_id) if k.revoked_at is None]
        stored = await scoped.checkpoint_bytes(conn, viewer.who)
    return page(request, "account.html", page_context(viewer, "account", budgets=states, month=month,
                                                      credit=credit, audit=audit["entries"], keys=key_rows,
                                                      saved=saved, stored=stored))


@router.post("/account/budget")
async def account_budget(viewer: Changing, pool: Pool, monthly_usd: Annotated[str, Form(max_length=32)] = "",
                         api_key_prefix: Annotated[str, Form(max_length=64)] = ""):
    """Set a budget (the tenant's, or a key's); an empty amount removes it."""
    async with pool.connection() as conn:
        await account.change_budget(conn, viewer.who, monthly_usd.strip() or None, api_key_prefix or None)
    return RedirectResponse("/dashboard/account?saved=budget", status_code=303)


@router.get("/billing")
async def billing_page(request: Request, viewer: LoggedIn, pool: Pool, card: str | None = Query(None, max_length=20)):
    """Your payment method and invoices (from Stripe), and whether a payment is overdue."""
    settings = get_billing_settings()
    async with pool.connection() as conn:
        acct = await (await conn.execute(
            "SELECT stripe_customer_id, card_brand, card_last4, payment_failed_at, payment_failed_invoice "
            "FROM billing_accounts WHERE tenant_id = %s", (viewer.who.tenant_id,))).fetchone()
    invoices, problem = [], None
    if not settings.stripe_enabled:
        problem = "This server does not bill through Stripe."
    elif acct is None:
        problem = "Your Stripe customer is being created; reload in a minute."
    else:
        try:
            invoices = await run_in_threadpool(StripeGateway(settings).invoices, acct["stripe_customer_id"])
        except stripe.StripeError as exc:
            problem = f"Stripe did not answer ({type(exc).__name__}); invoices are not shown now."
    response = page(request, "billing.html", page_context(viewer, "billing", account=acct, invoices=invoices,
                                                          problem=problem, card_saved=card == "saved",
                                                          grace_days=settings.payment_grace_s / 86_400))
    # The card form is answered by a redirect to Stripe Checkout, which form-action must allow.
    response.headers["Content-Security-Policy"] = csp_with_form_action(_checkout_origin(settings))
    return response


def _checkout_origin(settings) -> str:
    if settings.stripe_api_base:  # a Stripe-compatible server (the local fake) hosts its own pages
        parts = urlsplit(settings.stripe_api_base)
        return f"{parts.scheme}://{parts.netloc}"
    return "https://checkout.stripe.com"


@router.post("/billing/card")
async def billing_card(request: Request, viewer: OwnerChanging, pool: Pool):
    """(Owners.) Start Stripe Checkout (setup mode) to add or replace the card invoices are charged to."""
    settings = get_billing_settings()
    async with pool.connection() as conn:
        acct = await (await conn.execute("SELECT stripe_customer_id FROM billing_accounts WHERE tenant_id = %s",
                                         (viewer.who.tenant_id,))).fetchone()
    if not settings.stripe_enabled or acct is None:
        raise NotFound("this tenant has no Stripe customer yet", field="billing")
    url = await run_in_threadpool(StripeGateway(settings).setup_checkout, customer_id=acct["stripe_customer_id"],
                                  success_url=links.link(request, "/dashboard/billing?card=saved"),
                                  cancel_url=links.link(request, "/dashboard/billing"))
    return RedirectResponse(url, status_code=303)


@router.get("/tenants")
async def tenants_page(request: Request, viewer: OperatorOnly, pool: Pool):
    """(Operators.) Every tenant: role, plan, quotas, suspension, month's spend and credit."""
    async with pool.connection() as conn:
        rows = await (await conn.execute(
            "SELECT t.id, t.name, t.role, t.plan_weight, t.max_models, t.max_inflight_requests, "
            "t.tokens_per_minute, t.max_checkpoint_bytes, t.suspended_kind, t.suspended_reason, t.suspended_at "
            "FROM tenants t "
            "ORDER BY t.created_at")).fetchall()
        audit = await account.audit_json(conn, viewer.who, None, limit=50)
    return page(request, "tenants.html", page_context(viewer, "tenants", tenants=rows, audit=audit["entries"]))


def _back(name: str) -> RedirectResponse:
    return RedirectResponse(f"/dashboard/tenants#tenant-{name}", status_code=303)


@router.post("/tenants/{name}/suspend")
async def tenant_suspend(name: str, viewer: OperatorChanging, pool: Pool, callers: Callers,
                         reason: Annotated[str, Form(max_length=500)] = "",
                         kind: Annotated[Literal["operator", "payment"], Form()] = "operator"):
    """Suspend a tenant with a reason it will see."""
    if not reason.strip():
        raise InvalidInput("reason: say why (the tenant sees it with every refusal)", field="reason")
    async with changing(pool, callers) as conn:
        await account.suspend(conn, viewer.who, name, kind, reason.strip())
    return _back(name)


@router.post("/tenants/{name}/restore")
async def tenant_restore(name: str, viewer: OperatorChanging, pool: Pool, callers: Callers):
    """Lift a tenant's suspension."""
    async with changing(pool, callers) as conn:
        await account.restore(conn, viewer.who, name)
    return _back(name)


@router.post("/tenants/{name}/plan")
async def tenant_plan(name: str, viewer: OperatorChanging, pool: Pool, callers: Callers,
                      tokens_per_minute: Annotated[int, Form(ge=1, le=2**31 - 1)],
                      max_inflight_requests: Annotated[int, Form(ge=1, le=2**31 - 1)],
                      max_models: Annotated[int, Form(ge=1, le=2**31 - 1)],
                      plan_weight: Annotated[float, Form(gt=0, le=1000, allow_inf_nan=False)],
                      checkpoint_gib: Annotated[float | None, Form(gt=0, le=2**32, allow_inf_nan=False)] = None):
    """A tenant's quotas and fair-share weight (its checkpoint storage in GiB)."""
    changes = {"tokens_per_minute": tokens_per_minute, "max_inflight_requests": max_inflight_requests,
               "max_models": max_models, "plan_weight": plan_weight}
    if checkpoint_gib is not None:
        changes["max_checkpoint_bytes"] = max(1, round(checkpoint_gib * 2**30))
    async with changing(pool, callers) as conn:
        await account.set_plan(conn, viewer.who, name, changes)
    return _back(name)


@router.post("/tenants/{name}/credits")
async def tenant_credit(name: str, viewer: OperatorChanging, pool: Pool,
                        usd: Annotated[str, Form(max_length=32)] = "",
                        reason: Annotated[str, Form(max_length=500)] = "",
                        category: Annotated[Literal["paid", "promotional"], Form()] = "promotional"):
    """Grant a tenant credit."""
    if not reason.strip():
        raise InvalidInput("reason: say why the credit is granted", field="reason")
    async with pool.connection() as conn:
        await account.grant(conn, viewer.who, name, usd.strip(), category, reason.strip())
    return _back(name)
