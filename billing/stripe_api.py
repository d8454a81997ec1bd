"""The few Stripe calls Quilt makes, through the official `stripe` SDK.

`StripeGateway` owns one `stripe.StripeClient`. With `QUILT_STRIPE_API_KEY` alone it talks to live
Stripe; `QUILT_STRIPE_API_BASE` points both of stripe-python's base addresses that we use (`api`,
`meter_events`) at another server, such as `billing.fake_stripe` in tests.

Every create call carries an idempotency key, and every meter event an `identifier`, both derived
from our own ids, so a retried call is recognised by Stripe instead of being counted again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

import stripe

from core.settings import BillingSettings

log = logging.getLogger("quilt.billing.stripe")

FAKE_KEY = "sk_test_quilt_local"  # used only with stripe_api_base and no key

SendOutcome = Literal["accepted", "duplicate", "failed", "retry", "abort"]


@dataclass(frozen=True)
class SendResult:
    """What became of one meter event.

    accepted: Stripe took it now. duplicate: Stripe already had this identifier (an earlier attempt
    reached it), so it is acknowledged too. failed: Stripe refused it for good (e.g. too old).
    retry: a transient problem (network, 5xx, 429); send again later. abort: our credentials or
    configuration are wrong; stop this run, send again later.
    """

    outcome: SendOutcome
    message: str = ""

    @property
    def acknowledged(self) -> bool:
        return self.outcome in ("accepted", "duplicate")


def _is_duplicate(err: stripe.InvalidRequestError) -> bool:
    text = (err.user_message or str(err) or "").lower()
    return err.code == "resource_already_exists" or ("identifier" in text and ("already" in text or "duplicate" in text))


class StripeGateway:
    def __init__(self, settings: BillingSettings, *, http_client: stripe.HTTPClient | None = None):
        if not settings.stripe_enabled:
            raise ValueError("Stripe is not configured: set QUILT_STRIPE_API_KEY (or QUILT_STRIPE_API_BASE)")
        base = settings.stripe_api_base.rstrip("/")
        self.live = not base
        self.client = stripe.StripeClient(
            settings.stripe_api_key.get_secret_value() or FAKE_KEY,
            base_addresses={"api": base, "meter_events": base} if base else None,
            max_network_retries=settings.stripe_max_network_retries,
            http_client=http_client or stripe.RequestsClient(timeout=settings.stripe_timeout_s),
        )

    # ------------------------------------------------------------------------------- customers

    def create_customer(self, *, tenant_id: str, tenant_name: str) -> str:
        """Create the tenant's customer; the idempotency key makes a retry return the same one."""
        customer = self.client.v1.customers.create(
            params={"name": tenant_name, "metadata": {"quilt_tenant_id": tenant_id}},
            options={"idempotency_key": f"quilt-customer-{tenant_id}"},
        )
        return customer.id

    # --------------------------------------------------------------------- cards and invoices

    def setup_checkout(self, *, customer_id: str, success_url: str, cancel_url: str) -> str:
        """A Checkout session in setup mode (the customer saves a card for later invoices); its URL."""
        session = self.client.v1.checkout.sessions.create(params={
            "mode": "setup", "customer": customer_id, "currency": "usd", "payment_method_types": ["card"],
            "success_url": success_url, "cancel_url": cancel_url})
        return session.url

    def card_of_setup(self, setup_intent_id: str) -> tuple[str, str, str]:
        """(payment method id, brand, last4) of a succeeded SetupIntent."""
        intent = self.client.v1.setup_intents.retrieve(setup_intent_id, params={"expand": ["payment_method"]})
        pm = intent.payment_method
        return pm.id, pm.card.brand, pm.card.last4

    def make_default_card(self, customer_id: str, payment_method_id: str) -> None:
        """Invoices charge this card from now on."""
        self.client.v1.customers.update(
            customer_id, params={"invoice_settings": {"default_payment_method": payment_method_id}})

    def invoices(self, customer_id: str, limit: int = 24) -> list[dict]:
        """The customer's latest invoices: number, status, amounts (cents), link, created (epoch s)."""
        listed = self.client.v1.invoices.list(params={"customer": customer_id, "limit": limit})
        return [{"id": i.id, "number": i.number, "status": i.status, "amount_due": i.amount_due,
                 "amount_paid": i.amount_paid, "currency": i.currency, "url": i.hosted_invoice_url,
                 "created": i.created} for i in listed.data]

    def create_credit_grant(self, *, grant_id: int, customer_id: str, amount_cents: int, category: str,
                            name: str) -> str:
        """A Billing credit grant that Stripe applies to the customer's metered usage before charging;
        the idempotency key makes a retry return the same grant."""
        grant = self.client.v1.billing.credit_grants.create(
            params={"customer": customer_id, "name": name[:100], "category": category,
                    "amount": {"type": "monetary", "monetary": {"currency": "usd", "value": amount_cents}},
                    "applicability_config": {"scope": {"price_type": "metered"}},
                    "metadata": {"quilt_credit_grant_id": str(grant_id)}},
            options={"idempotency_key": f"quilt-credit-grant-{grant_id}"},
        )
        return grant.id

    # ---------------------------------------------------------------------------------- meters

    def find_meters(self) -> dict[str, str]:
        """Active meters: event_name -> meter id."""
        out = {}
        for meter in self.client.v1.billing.meters.list(params={"limit": 100, "status": "active"}).auto_paging_iter():
            out[meter.event_name] = meter.id
        return out

    def create_meter(self, event_name: str, display_name: str) -> str:
        meter = self.client.v1.billing.meters.create(
            params={
                "display_name": display_name,
                "event_name": event_name,
                "default_aggregation": {"formula": "sum"},
                "customer_mapping": {"event_payload_key": "stripe_customer_id", "type": "by_id"},
                "value_settings": {"event_payload_key": "value"},
            },
            options={"idempotency_key": f"quilt-meter-{event_name}"},
        )
        return meter.id

    def meter_total(self, meter_id: str, customer_id: str, start: datetime, end: datetime) -> int:
        """What Stripe has aggregated for one customer on one meter in [start, end) (whole hours).

        Stripe aggregates asynchronously, so very recent events may not be counted yet."""
        total = 0
        summaries = self.client.v1.billing.meters.event_summaries.list(
            meter_id, params={"customer": customer_id, "start_time": int(start.timestamp()),
                              "end_time": int(end.timestamp()), "limit": 100})
        for s in summaries.auto_paging_iter():
            total += round(float(s.aggregated_value))
        return total

    # ---------------------------------------------------------------------------- meter events

    def send_meter_event(self, *, identifier: str, event_name: str, customer_id: str, value: int,
                         timestamp: datetime) -> SendResult:
        """POST /v1/billing/meter_events; never raises for Stripe's answers, only classifies them."""
        try:
            self.client.v1.billing.meter_events.create(
                params={
                    "event_name": event_name,
                    "identifier": identifier,
                    "timestamp": int(timestamp.timestamp()),
                    "payload": {"stripe_customer_id": customer_id, "value": str(value)},
                },
                options={"idempotency_key": identifier},
            )
            return SendResult("accepted")
        except stripe.IdempotencyError as err:
            return SendResult("failed", f"idempotency conflict: {err.user_message or err}")
        except stripe.InvalidRequestError as err:
            if _is_duplicate(err):
                return SendResult("duplicate", err.user_message or str(err))
            return SendResult("failed", f"{err.code or 'invalid_request'}: {err.user_message or err}")
        except (stripe.AuthenticationError, stripe.PermissionError) as err:
            return SendResult("abort", f"{type(err).__name__}: {err.user_message or err}")
        except (stripe.RateLimitError, stripe.APIConnectionError, stripe.APIError) as err:
            return SendResult("retry", f"{type(err).__name__}: {err.user_message or err}")
        except stripe.StripeError as err:
            return SendResult("retry", f"{type(err).__name__}: {err.user_message or err}")
