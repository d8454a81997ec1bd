"""A Stripe customer per billed tenant.

Billed tenants are those with role `tenant` (operators run the platform and are not billed). A
customer is created by a Celery task when the tenant is created (`quilt tenants create` enqueues it)
and, for any tenant that still lacks one, by the periodic sweep and at the start of every sync.
"""

from __future__ import annotations

import logging

import psycopg
from psycopg.rows import DictRow, dict_row

from billing.stripe_api import StripeGateway

ENSURE_CUSTOMER_TASK = "quilt.billing.ensure_customer"  # billing.tasks.ensure_customer, sent by name

log = logging.getLogger("quilt.billing")

_MISSING = """
SELECT t.id, t.name FROM tenants t LEFT JOIN billing_accounts b ON b.tenant_id = t.id
WHERE b.tenant_id IS NULL AND t.role = 'tenant' ORDER BY t.created_at
"""


def customer_of(conn: psycopg.Connection[DictRow], tenant_id: str) -> str | None:
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute("SELECT stripe_customer_id FROM billing_accounts WHERE tenant_id = %s",
                          (tenant_id,)).fetchone()
    return row["stripe_customer_id"] if row else None


def ensure_customer(conn: psycopg.Connection[DictRow], gateway: StripeGateway, tenant_id: str) -> str | None:
    """The tenant's Stripe customer id, creating it if needed; None for a tenant that is not billed
    (or not there). Safe to run twice at once: Stripe sees one idempotency key, we keep one row."""
    existing = customer_of(conn, tenant_id)
    if existing:
        return existing
    with conn.cursor(row_factory=dict_row) as cur:
        tenant = cur.execute("SELECT id, name, role FROM tenants WHERE id = %s", (tenant_id,)).fetchone()
    if tenant is None or tenant["role"] != "tenant":
        return None
    customer_id = gateway.create_customer(tenant_id=tenant["id"], tenant_name=tenant["name"])
    # Usage from the tenant's first hour on is billed.
    conn.execute(
        "INSERT INTO billing_accounts (tenant_id, stripe_customer_id, sync_from) "
        "SELECT id, %s, date_trunc('hour', created_at, 'UTC') FROM tenants WHERE id = %s "
        "ON CONFLICT (tenant_id) DO NOTHING",
        (customer_id, tenant_id),
    )
    if not conn.autocommit:
        conn.commit()
    log.info("tenant %s is Stripe customer %s", tenant_id, customer_id)
    return customer_of(conn, tenant_id)


def ensure_all_customers(conn: psycopg.Connection[DictRow], gateway: StripeGateway) -> int:
    """Create customers for every billed tenant that lacks one; returns how many were created."""
    with conn.cursor(row_factory=dict_row) as cur:
        missing = cur.execute(_MISSING).fetchall()
    for tenant in missing:
        ensure_customer(conn, gateway, tenant["id"])
    return len(missing)


def request_customer(tenant_id: str) -> bool:
    """Enqueue the Celery task that creates a new tenant's Stripe customer. False when Stripe is not
    configured here or the broker could not be reached; the periodic sweep
    (`quilt.billing.ensure_customers`) then does it."""
    from core.settings import get_billing_settings

    if not get_billing_settings().stripe_enabled:
        return False
    try:
        from core.celery_app import app

        app.send_task(ENSURE_CUSTOMER_TASK, (tenant_id,), retry=False)
        return True
    except Exception as exc:  # noqa: BLE001 - any broker failure: the sweep is the backstop
        log.warning("could not enqueue the Stripe customer of %s (%s); the periodic sweep will create it",
                    tenant_id, exc)
        return False
