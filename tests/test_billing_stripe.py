"""Stripe sync against a local fake of Stripe's HTTP API (billing.fake_stripe), driven by the real
`stripe` SDK: meter totals per customer equal the ledger, a resend is never counted twice, and a
Celery worker killed in the middle of a sync loses and duplicates nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from billing_workload import ledger_totals, run_workload, wait_recorded
from psycopg.rows import dict_row
from stackutil import datum, fb_body, new_model, wait_future

from billing import stripe_sync
from billing.fake_stripe import FakeStripe
from billing.stripe_api import StripeGateway
from billing.stripe_sync import METERS
from core.settings import BillingSettings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def fake():
    with FakeStripe() as f:
        yield f


@pytest.fixture(scope="module")
def settings(fake):
    return BillingSettings(stripe_api_base=fake.url, stripe_max_network_retries=0, billing_settle_s=0)


@pytest.fixture(scope="module")
def workload(stack):
    return run_workload(stack, prefix="stripe")


def _as_of() -> datetime:
    """Late enough that the current hour counts as sealed (the hourly beat waits for it to end)."""
    return datetime.now(UTC) + timedelta(hours=2)


def _db(stack):
    return psycopg.connect(stack.database_url, row_factory=dict_row, autocommit=True)


def _customers(stack, tenant_ids) -> dict[str, str]:
    with _db(stack) as conn:
        rows = conn.execute("SELECT tenant_id, stripe_customer_id FROM billing_accounts WHERE tenant_id = ANY(%s)",
                            (tenant_ids,)).fetchall()
    return {r["tenant_id"]: r["stripe_customer_id"] for r in rows}


def _assert_stripe_equals_ledger(stack, fake, tenant_ids) -> None:
    customers = _customers(stack, tenant_ids)
    assert set(customers) == set(tenant_ids)
    totals = fake.meter_totals()
    ledger = ledger_totals(stack.database_url, tenant_ids)
    assert all(ledger[t]["cost_micro_usd"] > 0 for t in tenant_ids)
    for tenant_id in tenant_ids:
        for meter in METERS:
            sent = totals.get((customers[tenant_id], f"quilt_{meter.key}"), 0)
            assert sent == ledger[tenant_id][meter.key], (tenant_id, meter.key)


def _assert_reconciled(stack, settings, tenant_ids, as_of) -> None:
    report = stripe_sync.reconcile(stack.database_url, settings, gateway=StripeGateway(settings), as_of=as_of)
    mine = [line for line in report.lines if line.tenant_id in tenant_ids]
    assert len(mine) == len(tenant_ids) * len(METERS)
    assert [line.explain() for line in mine if not line.ok] == []
    assert all(line.stripe == line.ledger for line in mine)
    assert not [d for d in report.rollup_drift if d.split()[0] in tenant_ids]


def _meter_event_posts(fake) -> int:
    return sum(1 for method, path in fake.request_log if path == "/v1/billing/meter_events")


def test_meter_totals_per_customer_equal_the_ledger(stack, fake, settings, workload):
    as_of = _as_of()
    report = stripe_sync.sync(stack.database_url, settings, as_of=as_of)
    assert report.failed == 0 and report.left_pending == 0 and not report.anomalies, report
    assert report.accepted >= len(workload.tenants) and report.meters_created == len(METERS)
    _assert_stripe_equals_ledger(stack, fake, workload.tenant_ids)
    _assert_reconciled(stack, settings, workload.tenant_ids, as_of)
    # Running again sends nothing: every window is acknowledged, no identifier goes out twice.
    posts = _meter_event_posts(fake)
    again = stripe_sync.sync(stack.database_url, settings, as_of=as_of)
    assert (again.planned, again.accepted) == (0, 0) and _meter_event_posts(fake) == posts
    assert fake.duplicate_identifiers == [] and not [k for k in fake.idempotent_replays if ":" in k]


def test_usage_after_a_window_was_sent_goes_out_as_a_revision(stack, fake, settings, workload):
    stripe_sync.sync(stack.database_url, settings, as_of=_as_of())
    tenant = workload.tenants[0]
    client = stack.http(tenant.key)
    model = new_model(client, rank=4, seed=11)
    r = client.post("/forward_backward", json=fb_body(model, 1, [datum(list(range(5, 45)))])).json()
    wait_future(client, r["request_id"])
    wait_recorded(stack.database_url, [tenant.tenant_id])
    as_of = _as_of()
    report = stripe_sync.sync(stack.database_url, settings, as_of=as_of)
    assert report.planned >= 2 and report.failed == 0  # cost and train tokens of the late request
    with _db(stack) as conn:
        revisions = conn.execute("SELECT max(revision) AS r FROM stripe_meter_events WHERE tenant_id = %s",
                                 (tenant.tenant_id,)).fetchone()["r"]
    assert revisions >= 2
    _assert_stripe_equals_ledger(stack, fake, workload.tenant_ids)
    _assert_reconciled(stack, settings, workload.tenant_ids, as_of)


# ------------------------------------------------------------------------- a worker killed mid-sync


def _start_worker(stack, fake, queue: str, log_path: str) -> subprocess.Popen:
    env = {**os.environ, "QUILT_DATABASE_URL": stack.database_url, "QUILT_REDIS_URL": stack.redis_url,
           "QUILT_DATA_DIR": str(stack.data_dir), "QUILT_STRIPE_API_BASE": fake.url,
           "QUILT_STRIPE_MAX_NETWORK_RETRIES": "0", "QUILT_BILLING_SETTLE_S": "0"}
    env.pop("QUILT_STRIPE_API_KEY", None)
    with open(log_path, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "celery", "-A", "stack.celery_worker", "worker", "-Q", queue,
                                 "--concurrency", "1", "--loglevel", "INFO", "-n", f"{queue}@%h"],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _wait_sync_lock_free(stack, timeout_s: float = 30) -> None:
    """A killed worker's Postgres session (and its advisory lock) ends when Postgres notices."""
    deadline = time.monotonic() + timeout_s
    with _db(stack) as conn:
        while time.monotonic() < deadline:
            held = conn.execute("SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' AND objid = %s",
                                (stripe_sync.SYNC_LOCK_ID & 0xFFFFFFFF,)).fetchone()["n"]
            if not held:
                return
            time.sleep(0.05)
    raise TimeoutError("the killed worker's sync lock was not released")


def test_killing_the_worker_mid_sync_loses_and_duplicates_nothing(stack, fake, settings, workload, tmp_path):
    from celery import Celery

    from core.embedded import celery_url

    stripe_sync.sync(stack.database_url, settings, as_of=_as_of())  # start from a synced state
    more = run_workload(stack, seed=7, prefix="killsync")
    tenant_ids = workload.tenant_ids + more.tenant_ids
    queue = f"billing-test-{uuid.uuid4().hex[:8]}"
    broker = celery_url(stack.redis_url)
    app = Celery("billing-test", broker=broker, backend=broker)
    as_of = _as_of().isoformat()
    log_path = str(tmp_path / "celery-billing.log")

    reached = fake.hang_on_meter_event(3)  # the third event: accepted by Stripe, never answered
    worker = _start_worker(stack, fake, queue, log_path)
    try:
        app.send_task("quilt.billing.sync_stripe", kwargs={"as_of": as_of}, queue=queue)
        assert reached.wait(120), Path(log_path).read_text()[-3000:]
        _kill(worker)
    finally:
        fake.release()
        _kill(worker)
    held = fake.held_identifiers[-1]
    with _db(stack) as conn:
        state = {r["identifier"]: r for r in conn.execute(
            "SELECT identifier, status, attempts FROM stripe_meter_events WHERE tenant_id = ANY(%s)", (tenant_ids,))}
    assert state[held]["status"] == "pending" and state[held]["attempts"] == 1  # Stripe has it; we do not know
    assert sum(r["status"] == "pending" for r in state.values()) >= 2  # killed mid-sync, work left
    _wait_sync_lock_free(stack)

    worker = _start_worker(stack, fake, queue, log_path)
    try:
        out = app.send_task("quilt.billing.sync_stripe", kwargs={"as_of": as_of}, queue=queue).get(timeout=120)
    finally:
        _kill(worker)
    assert out["failed"] == 0 and out["left_pending"] == 0 and not out["busy"], out
    # The held event was sent again with the same identifier and recognised, not counted twice.
    assert held in fake.idempotent_replays or held in fake.duplicate_identifiers
    assert out["duplicates"] + out["accepted"] >= 1
    _assert_stripe_equals_ledger(stack, fake, tenant_ids)
    _assert_reconciled(stack, settings, tenant_ids, datetime.fromisoformat(as_of))
    with _db(stack) as conn:
        left = conn.execute("SELECT count(*) AS n FROM stripe_meter_events WHERE status <> 'sent' "
                            "AND tenant_id = ANY(%s)", (tenant_ids,)).fetchone()["n"]
    assert left == 0


def test_the_tenant_creation_task_creates_one_customer(stack, fake, tmp_path):
    from celery import Celery

    from billing.customers import request_customer
    from core.embedded import celery_url
    from core.settings import get_billing_settings

    if not get_billing_settings().stripe_enabled:
        assert request_customer("ten-anything") is False  # nothing to enqueue without Stripe
    tenant = stack.create_tenant("newcust")
    queue = f"billing-test-{uuid.uuid4().hex[:8]}"
    broker = celery_url(stack.redis_url)
    app = Celery("billing-test", broker=broker, backend=broker)
    worker = _start_worker(stack, fake, queue, str(tmp_path / "celery-customer.log"))
    try:
        first = app.send_task("quilt.billing.ensure_customer", args=(tenant.tenant_id,), queue=queue).get(timeout=120)
        again = app.send_task("quilt.billing.ensure_customer", args=(tenant.tenant_id,), queue=queue).get(timeout=120)
    finally:
        _kill(worker)
    assert first == again == _customers(stack, [tenant.tenant_id])[tenant.tenant_id]
    assert [c for c in fake.customers.values() if c["metadata"].get("quilt_tenant_id") == tenant.tenant_id] == \
        [fake.customers[first]]
