"""An API process billing through the local Stripe fake: the session stack's Postgres and Redis,
with Stripe settings of its own (the shared stack has none), and the fake's webhooks pointed at it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from stackutil import ROOT, free_port

from billing import customers
from billing.fake_stripe import FakeStripe
from billing.stripe_api import StripeGateway
from core import db
from core.settings import BillingSettings


@contextlib.contextmanager
def billing_api(stack, fake: FakeStripe, log_dir: Path, **env: str) -> Iterator[str]:
    """The base URL of a second API process whose Stripe is `fake`; the fake's webhooks go to it."""
    port = free_port()
    full_env = {**os.environ, "QUILT_DATABASE_URL": stack.database_url, "QUILT_REDIS_URL": stack.redis_url,
                "QUILT_DATA_DIR": str(stack.data_dir), "HF_HUB_OFFLINE": "1", "QUILT_STRIPE_API_BASE": fake.url,
                "QUILT_STRIPE_WEBHOOK_SECRET": fake.webhook_secret, "QUILT_STRIPE_MAX_NETWORK_RETRIES": "0", **env}
    full_env.pop("QUILT_STRIPE_API_KEY", None)
    log = open(log_dir / f"billing-api-{port}.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory", "api.app:create_app", "--host",
                             "127.0.0.1", "--port", str(port)], cwd=ROOT, env=full_env, stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (log_dir / f"billing-api-{port}.log").read_text()
            try:
                if httpx.get(url + "/api/v1/healthz", timeout=5).status_code in (200, 503):
                    break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        fake.webhook_url = url + "/api/v1/stripe/webhook"
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def billed_customer(stack, fake: FakeStripe, tenant_id: str) -> str:
    """The tenant's Stripe customer in the fake (created as the Celery task would)."""
    gateway = StripeGateway(BillingSettings(stripe_api_base=fake.url, stripe_max_network_retries=0))
    with db.connect(stack.database_url) as conn:
        return customers.ensure_customer(conn, gateway, tenant_id)
