"""Celery tasks of billing: Stripe customers, the hourly meter-event sync, reconciliation.

All are safe to run twice or concurrently (idempotency keys, identifiers, an advisory lock), and
all do nothing but log when Stripe is not configured.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from datetime import datetime

import psycopg
from psycopg.rows import dict_row

from billing import customers, payments, storage, stripe_sync
from billing.stripe_api import StripeGateway
from core import db
from core.celery_app import app
from core.settings import get_billing_settings

log = logging.getLogger("quilt.billing.tasks")


def _as_of(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text) if text else None


@app.task(name=customers.ENSURE_CUSTOMER_TASK, bind=True, max_retries=8, default_retry_delay=30)
def ensure_customer(self, tenant_id: str) -> str | None:
    """Create the Stripe customer of a new tenant (enqueued by `quilt tenants create`)."""
    settings = get_billing_settings()
    if not settings.stripe_enabled:
        return None
    try:
        with psycopg.connect(db.resolve_url(), autocommit=True, row_factory=dict_row) as conn:
            return customers.ensure_customer(conn, StripeGateway(settings), tenant_id)
    except Exception as exc:  # Stripe or the database briefly unavailable: the sweep is the backstop
        log.warning("creating the Stripe customer of %s failed (%s); retrying", tenant_id, exc)
        raise self.retry(exc=exc) from exc


@app.task(name="quilt.billing.ensure_customers")
def ensure_customers() -> int:
    """Sweep: a customer for every billed tenant that lacks one."""
    settings = get_billing_settings()
    if not settings.stripe_enabled:
        return 0
    with psycopg.connect(db.resolve_url(), autocommit=True, row_factory=dict_row) as conn:
        return customers.ensure_all_customers(conn, StripeGateway(settings))


@app.task(name="quilt.billing.suspend_overdue")
def suspend_overdue() -> list[str]:
    """Every few minutes (Celery beat): suspend tenants whose invoice payment failed longer ago than
    QUILT_PAYMENT_GRACE_S and has not succeeded since (billing.payments)."""
    with psycopg.connect(db.resolve_url(), autocommit=True, row_factory=dict_row) as conn:
        suspended = payments.suspend_overdue(conn, get_billing_settings().payment_grace_s)
    if suspended:
        log.warning("suspended for failed payments: %s", ", ".join(suspended))
    return suspended


@app.task(name="quilt.billing.sync_stripe")
def sync_stripe(as_of: str | None = None) -> dict:
    """Hourly (Celery beat): roll sealed windows up into meter events, send them, reconcile.

    `as_of` (ISO 8601) replaces "now" when deciding which windows are sealed."""
    settings = get_billing_settings()
    url = db.resolve_url()
    report = stripe_sync.sync(url, settings, as_of=_as_of(as_of))
    out = asdict(report)
    if not (report.disabled or report.busy):
        check = stripe_sync.reconcile(url, settings, as_of=_as_of(as_of))
        out["gaps"] = [line.explain() for line in check.gaps] + check.rollup_drift
        if out["gaps"]:
            log.warning("%s", check.text())
    return out


@app.task(name="quilt.billing.reconcile")
def reconcile(as_of: str | None = None, with_stripe: bool = True) -> dict:
    """Compare the ledger with what Stripe acknowledged (and with Stripe's own summaries)."""
    settings = get_billing_settings()
    if not settings.stripe_enabled:
        return {"disabled": True}
    gateway = StripeGateway(settings) if with_stripe else None
    check = stripe_sync.reconcile(db.resolve_url(), settings, gateway=gateway, as_of=_as_of(as_of))
    if not check.ok:
        log.warning("%s", check.text())
    return {"ok": check.ok, "gaps": [line.explain() for line in check.gaps] + check.rollup_drift}


@app.task(name="quilt.billing.accrue_storage")
def accrue_storage(hour: str | None = None) -> int:
    """Hourly (Celery beat): bill every hour ended since the newest one billed (`storage.hours_to_accrue`:
    an hour missed while beat was down is billed now), or only `hour` (ISO 8601), for every tenant's
    live checkpoint bytes (billing.storage); running it again for the same hour bills nothing."""
    with psycopg.connect(db.resolve_url(), autocommit=True, row_factory=dict_row) as conn:
        if hour:
            return storage.accrue(conn, storage.hour_of(datetime.fromisoformat(hour)))
        now = db.one(conn.execute("SELECT now() AS now").fetchone())["now"]
        return sum(storage.accrue(conn, h) for h in storage.hours_to_accrue(storage.newest_accrued_hour(conn), now))
