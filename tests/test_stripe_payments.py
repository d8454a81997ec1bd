"""Stripe webhooks through the real `stripe` SDK's signature check, against events the local fake
signs as Stripe does: a bad signature is a 400 and changes nothing, a replayed event changes nothing
twice, a failed invoice payment suspends the tenant once the grace period is over (402 naming the
invoice) and a paid one lifts it; an operator's suspension is not lifted by a payment."""

from __future__ import annotations

import time

import httpx
import psycopg
import pytest
from psycopg.rows import dict_row
from stackutil import datum, fb_body, new_model, wait_future
from stripeutil import billed_customer, billing_api, stripe_fake

from billing import payments
from tenancy import accounts


@pytest.fixture(scope="module")
def fake(stack):
    with stripe_fake(stack) as f:
        yield f


@pytest.fixture(scope="module")
def api(stack, fake, tmp_path_factory):
    with billing_api(stack, fake, tmp_path_factory.mktemp("billing-api"), QUILT_PAYMENT_GRACE_S="0") as url:
        yield url


def _webhook(api: str, body: bytes, signature: str | None) -> httpx.Response:
    headers = {"Content-Type": "application/json"} | ({"Stripe-Signature": signature} if signature else {})
    return httpx.post(api + "/api/v1/stripe/webhook", content=body, headers=headers, timeout=30)


def _handled(stack, event_id: str) -> bool:
    with psycopg.connect(stack.database_url) as conn:
        return conn.execute("SELECT 1 FROM stripe_webhook_events WHERE event_id = %s", (event_id,)).fetchone() is not None


def _audit_actions(stack, tenant_id: str) -> list[str]:
    with psycopg.connect(stack.database_url) as conn:
        return [r[0] for r in conn.execute("SELECT action FROM audit_log WHERE tenant_id = %s ORDER BY id",
                                           (tenant_id,))]


def test_a_webhook_whose_signature_does_not_verify_is_400_and_changes_nothing(stack, fake, api, tenant):
    customer = billed_customer(stack, fake, tenant.tenant_id)
    invoice = fake.add_invoice(customer, 1000)
    body = fake.event("invoice.payment_failed", invoice, "evt_forged_1")
    for signature in (None, "t=1,v1=00", fake.sign(body, secret="whsec_someone_else"),
                      fake.sign(body, timestamp=int(time.time()) - 3600), fake.sign(body + b" ")):
        r = _webhook(api, body, signature)
        assert r.status_code == 400 and r.json()["field"] == "Stripe-Signature", (signature, r.text)
    assert not _handled(stack, "evt_forged_1")
    assert "invoice.payment_failed" not in _audit_actions(stack, tenant.tenant_id)
    with stack.http(tenant.key) as c:
        assert c.post("/create_session", json={}).status_code == 200
    garbage = b'{"not": "an event"'
    assert _webhook(api, garbage, fake.sign(garbage)).status_code == 400


def test_failed_payment_suspends_paid_restores_and_replays_change_nothing(stack, fake, api, tenant):
    customer = billed_customer(stack, fake, tenant.tenant_id)
    invoice = fake.add_invoice(customer, 2500)
    with stack.http(tenant.key) as c:
        model_id = new_model(c, rank=4)
        for _ in range(2):  # Stripe delivers at least once: the replay changes nothing
            r = fake.send_event("invoice.payment_failed", invoice, event_id="evt_fail_1")
            assert r.status_code == 200, r.text
        assert r.json()["outcome"] == "duplicate"
        refused = c.post("/forward_backward", json=fb_body(model_id, 1, [datum(list(range(20, 37)))]))
        assert refused.status_code == 402 and refused.json()["field"] == "tenant.suspended", refused.text
        assert invoice["number"] in refused.json()["error"]

        paid = {**invoice, "status": "paid", "amount_paid": invoice["amount_due"]}
        assert fake.send_event("invoice.paid", paid, event_id="evt_paid_1").json()["outcome"] == "handled"
        assert fake.send_event("invoice.paid", paid, event_id="evt_paid_1").json()["outcome"] == "duplicate"
        admitted = c.post("/forward_backward", json=fb_body(model_id, 2, [datum(list(range(20, 37)))]))
        assert admitted.status_code == 200, admitted.text
        assert "error" not in wait_future(c, admitted.json()["request_id"])
    assert [a for a in _audit_actions(stack, tenant.tenant_id) if a != "key.created"] == [
        "invoice.payment_failed", "tenant.suspended", "invoice.paid", "tenant.restored"]


def test_a_payment_does_not_lift_an_operators_suspension(stack, fake, api, tenant):
    customer = billed_customer(stack, fake, tenant.tenant_id)
    with psycopg.connect(stack.database_url, row_factory=dict_row) as conn:
        accounts.suspend(conn, tenant.tenant_id, "operator", "terms of service", "cli")
    paid = fake.add_invoice(customer, 100, status="paid")
    assert fake.send_event("invoice.paid", paid).json()["outcome"] == "handled"
    with stack.http(tenant.key) as c:
        refused = c.post("/create_session", json={})  # a suspended tenant starts nothing new
    assert refused.status_code == 403 and "terms of service" in refused.json()["error"]


def test_the_grace_period_holds_until_it_is_over(stack, fake, api, tenant, tmp_path):
    customer = billed_customer(stack, fake, tenant.tenant_id)
    with billing_api(stack, fake, tmp_path, QUILT_PAYMENT_GRACE_S="86400"):  # the fake now calls this one
        assert fake.send_event("invoice.payment_failed", fake.add_invoice(customer, 700)).status_code == 200
        with stack.http(tenant.key) as c:
            assert new_model(c, rank=4)  # within the grace: still served
        with psycopg.connect(stack.database_url, row_factory=dict_row) as conn:
            assert tenant.tenant_id not in payments.suspend_overdue(conn, 86_400)
            assert tenant.tenant_id in payments.suspend_overdue(conn, 0)  # what beat does once it is over
            assert tenant.tenant_id not in payments.suspend_overdue(conn, 0)  # once
    fake.webhook_url = api + "/api/v1/stripe/webhook"


def test_credit_grants_reach_stripe_once_as_billing_credit_grants(stack, fake, api, tenant):
    from dashutil import operator_key

    from billing import credits
    from billing.stripe_api import StripeGateway
    from core.settings import BillingSettings

    customer = billed_customer(stack, fake, tenant.tenant_id)
    with stack.http(operator_key(stack)) as op:
        r = op.post(f"/quilt/tenants/{tenant.name}/credits", json={"usd": "7.255", "reason": "pilot", "category": "paid"})
        assert r.status_code == 200, r.text
    gateway = StripeGateway(BillingSettings(stripe_api_base=fake.url, stripe_max_network_retries=0))
    with psycopg.connect(stack.database_url, autocommit=True, row_factory=dict_row) as conn:
        assert credits.send_to_stripe(conn, gateway) >= 1
        assert credits.send_to_stripe(conn, gateway) == 0  # sent once
    mine = [g for g in fake.credit_grants.values() if g["customer"] == customer]
    assert [(g["amount"]["monetary"]["value"], g["category"]) for g in mine] == [(725, "paid")]  # whole cents, down
