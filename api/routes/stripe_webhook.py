"""POST /api/v1/stripe/webhook: Stripe's events, verified by signature (billing.payments)."""

from __future__ import annotations

from fastapi import APIRouter, Header, Request
from fastapi.concurrency import run_in_threadpool

from api.caller_cache import changing
from api.deps import Callers, Pool
from api.input_guard import SignedBodyRoute, check_value
from billing import payments
from billing.stripe_api import StripeGateway
from core.errors import NotFound
from core.settings import get_billing_settings

router = APIRouter(route_class=SignedBodyRoute, tags=["billing"])


@router.post("/stripe/webhook")
async def stripe_webhook(request: Request, pool: Pool, callers: Callers,
                         stripe_signature: str | None = Header(None, max_length=4096)) -> dict:
    """Stripe's webhook endpoint (no API key: the signature is the permission). 400 for a body
    whose signature does not verify; an event already handled answers 200 and changes nothing."""
    settings = get_billing_settings()
    if settings.stripe_webhook_secret is None:
        raise NotFound("Stripe webhooks are not configured on this server (QUILT_STRIPE_WEBHOOK_SECRET)",
                       field="path")
    event = payments.verify(await request.body(), stripe_signature, settings.stripe_webhook_secret.get_secret_value())
    check_value(event)  # verified, so Stripe's: still text Postgres must be able to store
    async with changing(pool, callers) as conn:  # it may suspend or restore a tenant
        outcome = await payments.handle(conn, event, lambda: StripeGateway(settings), settings.payment_grace_s,
                                        run_in_threadpool)
    return {"received": True, "outcome": outcome}
