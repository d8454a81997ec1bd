"""Stripe's webhooks and what they change: the card on file, failed and paid invoices, and the
suspension of a tenant whose payment stays failed past `QUILT_PAYMENT_GRACE_S`.

`verify` is stripe-python's own signature check (`stripe.Webhook.construct_event`: HMAC-SHA256 of
the raw body under the endpoint's secret, and a timestamp at most five minutes old); anything it
refuses is a 400 and changes nothing. Stripe delivers an event at least once, so each event id is
recorded in the same transaction as its effect: a replay finds it and changes nothing again, and
a failure midway leaves neither (Stripe retries).

Events handled: `checkout.session.completed` (setup mode: the new card becomes the customer's
default for invoices), `invoice.payment_failed` (the first failure's time is kept; past the grace
the tenant is suspended with kind `payment`), `invoice.paid` (the failure is forgotten and a
payment suspension lifted). Other events are acknowledged and ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import psycopg
import stripe
from psycopg.rows import DictRow

from billing.stripe_api import StripeGateway
from core.errors import InvalidInput
from tenancy import accounts

log = logging.getLogger("quilt.billing.payments")

ACTOR = "stripe"

# Every tenant whose failed payment is older than the grace and that is not suspended yet: suspended
# with the invoice named, one audit row each, in one statement (the webhook and Celery beat both
# run it).
_SUSPEND_OVERDUE = """
WITH due AS (
    UPDATE tenants t SET suspended_at = now(), suspended_kind = 'payment',
           suspended_reason = 'the payment of invoice ' || b.payment_failed_invoice || ' failed on '
                              || to_char(b.payment_failed_at AT TIME ZONE 'UTC', 'YYYY-MM-DD')
    FROM billing_accounts b
    WHERE b.tenant_id = t.id AND t.suspended_at IS NULL
      AND b.payment_failed_at <= now() - make_interval(secs => %s)
    RETURNING t.id, t.suspended_reason
)
INSERT INTO audit_log (tenant_id, actor, action, detail)
SELECT id, 'stripe', 'tenant.suspended', jsonb_build_object('kind', 'payment', 'reason', suspended_reason) FROM due
RETURNING tenant_id
"""


def verify(payload: bytes, signature: str | None, secret: str) -> dict:
    """The event, if `signature` is Stripe's for `payload`; else InvalidInput (a 400)."""
    if not signature:
        raise InvalidInput("missing Stripe-Signature header", field="Stripe-Signature")
    try:
        event = stripe.Webhook.construct_event(payload, signature, secret)
    except stripe.SignatureVerificationError as exc:
        raise InvalidInput(f"Stripe-Signature does not verify: {exc.user_message or exc}",
                           field="Stripe-Signature") from None
    except ValueError as exc:
        raise InvalidInput(f"the webhook body is not a Stripe event: {exc}", field="body") from None
    return event.to_dict()


def suspend_overdue(conn: psycopg.Connection[DictRow], grace_s: int) -> list[str]:
    """Suspend every tenant whose payment failed more than `grace_s` ago (Celery beat; `conn` with
    dict rows); their ids."""
    with conn.transaction():
        return [r["tenant_id"] for r in conn.execute(_SUSPEND_OVERDUE, (grace_s,)).fetchall()]


async def handle(conn: psycopg.AsyncConnection[DictRow], event: dict, gateway: Callable[[], StripeGateway],
                 grace_s: int, run_sync) -> str:
    """Apply one verified event in the caller's transaction: "handled", "duplicate" or "ignored".
    `run_sync` runs a blocking Stripe call off the event loop."""
    cur = await conn.execute("INSERT INTO stripe_webhook_events (event_id, type) VALUES (%s, %s) "
                             "ON CONFLICT DO NOTHING RETURNING event_id", (event["id"], event["type"]))
    if await cur.fetchone() is None:
        return "duplicate"
    obj = (event.get("data") or {}).get("object") or {}
    customer = obj.get("customer")
    if not isinstance(customer, str):
        return "ignored"
    row = await (await conn.execute("SELECT tenant_id FROM billing_accounts WHERE stripe_customer_id = %s",
                                    (customer,))).fetchone()
    if row is None:
        log.warning("Stripe event %s (%s) names customer %s, which is no tenant's", event["id"], event["type"], customer)
        return "ignored"
    tenant_id = row["tenant_id"]
    kind = event["type"]
    if kind == "checkout.session.completed" and obj.get("mode") == "setup" and obj.get("setup_intent"):
        pm, brand, last4 = await run_sync(gateway().card_of_setup, obj["setup_intent"])
        await run_sync(gateway().make_default_card, customer, pm)
        await conn.execute("UPDATE billing_accounts SET card_brand = %s, card_last4 = %s WHERE tenant_id = %s",
                           (brand, last4, tenant_id))
        await _record(conn, tenant_id, "card.saved", brand=brand, last4=last4)
    elif kind == "invoice.payment_failed":
        await conn.execute("UPDATE billing_accounts SET payment_failed_at = COALESCE(payment_failed_at, now()), "
                           "payment_failed_invoice = %s WHERE tenant_id = %s", (obj.get("number") or obj["id"], tenant_id))
        await _record(conn, tenant_id, "invoice.payment_failed", invoice=obj.get("number") or obj.get("id"))
        await conn.execute(_SUSPEND_OVERDUE, (grace_s,))
    elif kind == "invoice.paid":
        await conn.execute("UPDATE billing_accounts SET payment_failed_at = NULL, payment_failed_invoice = NULL "
                           "WHERE tenant_id = %s", (tenant_id,))
        await _record(conn, tenant_id, "invoice.paid", invoice=obj.get("number") or obj.get("id"))
        await accounts.restore_async(conn, tenant_id, ACTOR, only_kind="payment")
    else:
        return "ignored"
    return "handled"


async def _record(conn, tenant_id: str, action: str, **detail) -> None:
    await accounts.record_async(conn, tenant_id, ACTOR, action, **detail)
