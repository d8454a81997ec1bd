"""An API process billing through the local Stripe fake (the shared stack has no Stripe), with the
fake's webhooks pointed at it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from stackutil import second_api

from billing import customers
from billing.fake_stripe import FakeStripe
from billing.stripe_api import StripeGateway
from core import db
from core.settings import BillingSettings


@contextlib.contextmanager
def billing_api(stack, fake: FakeStripe, log_dir: Path, **env: str) -> Iterator[str]:
    """The base URL of a second API process whose Stripe is `fake`; the fake's webhooks go to it."""
    with second_api(stack, log_dir, QUILT_STRIPE_API_BASE=fake.url, QUILT_STRIPE_WEBHOOK_SECRET=fake.webhook_secret,
                    QUILT_STRIPE_MAX_NETWORK_RETRIES="0", **env) as url:
        fake.webhook_url = url + "/api/v1/stripe/webhook"
        yield url


def billed_customer(stack, fake: FakeStripe, tenant_id: str) -> str:
    """The tenant's Stripe customer in the fake (created as the Celery task would)."""
    gateway = StripeGateway(BillingSettings(stripe_api_base=fake.url, stripe_max_network_retries=0))
    with db.connect(stack.database_url) as conn:
        return customers.ensure_customer(conn, gateway, tenant_id)


@contextlib.contextmanager
def stripe_fake(stack) -> Iterator[FakeStripe]:
    """A running fake; afterwards the billing accounts of its customers go too, since another test's
    Stripe sync over the shared database must not send usage to customers its own fake never had."""
    with FakeStripe() as fake:
        yield fake
        with db.connect(stack.database_url) as conn:
            conn.execute("DELETE FROM billing_accounts WHERE stripe_customer_id = ANY(%s)", (list(fake.customers),))
