"""The Stripe roll-up plan (pure) and the local fake of Stripe, without the stack."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
import stripe

from billing.fake_stripe import FakeStripe
from billing.stripe_api import StripeGateway
from billing.stripe_sync import (
    METERS,
    PlannedSoFar,
    WindowTotal,
    identifier,
    plan_events,
)
from core.settings import BillingSettings
from stack.ephemeral import free_port

H10 = datetime(2026, 7, 1, 10, tzinfo=UTC)
COST = "quilt_cost_micro_usd"
TRAIN = "quilt_train_tokens"


def _window(cost: int, train: int, start: datetime = H10) -> WindowTotal:
    return WindowTotal("ten-a", "cus_a", start, {"cost_micro_usd": cost, "prefill_tokens": 0, "sample_tokens": 0,
                                                 "train_tokens": train})


def test_identifier_is_derived_from_customer_meter_window_and_revision():
    assert identifier("cus_a", COST, H10, 1) == "cus_a:quilt_cost_micro_usd:20260701T10Z"
    assert identifier("cus_a", COST, H10, 2) == "cus_a:quilt_cost_micro_usd:20260701T10Z:r2"
    other_tz = H10.astimezone(timezone(timedelta(hours=5, minutes=30)))
    assert identifier("cus_a", COST, other_tz, 1) == identifier("cus_a", COST, H10, 1)
    long = identifier("cus_" + "x" * 90, COST, H10, 1)
    assert len(long) <= 100 and long == identifier("cus_" + "x" * 90, COST, H10, 1)


def test_first_plan_sends_each_nonzero_meter_once():
    events, anomalies = plan_events([_window(120, 3000)], {}, "quilt")
    assert not anomalies
    assert {(e.event_name, e.value, e.revision) for e in events} == {(COST, 120, 1), (TRAIN, 3000, 1)}


def test_nothing_new_plans_nothing():
    planned = {("ten-a", COST, H10): PlannedSoFar(120, 1), ("ten-a", TRAIN, H10): PlannedSoFar(3000, 1)}
    assert plan_events([_window(120, 3000)], planned, "quilt") == ([], [])


def test_late_usage_becomes_a_new_revision_carrying_the_difference():
    planned = {("ten-a", COST, H10): PlannedSoFar(120, 1), ("ten-a", TRAIN, H10): PlannedSoFar(3000, 1)}
    events, _ = plan_events([_window(150, 3000)], planned, "quilt")
    assert [(e.event_name, e.value, e.revision, e.identifier.endswith(":r2")) for e in events] == \
        [(COST, 30, 2, True)]


def test_an_outbox_ahead_of_the_ledger_is_reported_not_corrected():
    planned = {("ten-a", COST, H10): PlannedSoFar(200, 1)}
    events, anomalies = plan_events([_window(150, 0)], planned, "quilt")
    assert events == [] and len(anomalies) == 1 and "outbox holds 200, ledger 150" in anomalies[0]


def test_there_is_a_meter_per_unit_and_one_for_cost():
    assert {m.key for m in METERS} == {"cost_micro_usd", "prefill_tokens", "sample_tokens", "train_tokens"}


# ----------------------------------------------------------------------------- the fake Stripe


@pytest.fixture
def fake():
    with FakeStripe() as f:
        yield f


@pytest.fixture
def gateway(fake):
    return StripeGateway(BillingSettings(stripe_api_base=fake.url, stripe_max_network_retries=0))


def _ready(fake, gateway) -> str:
    customer = gateway.create_customer(tenant_id="ten-a", tenant_name="acme")
    gateway.create_meter(COST, "cost")
    return customer


def test_customer_creation_is_idempotent(fake, gateway):
    first = gateway.create_customer(tenant_id="ten-a", tenant_name="acme")
    assert gateway.create_customer(tenant_id="ten-a", tenant_name="acme") == first
    assert len(fake.customers) == 1 and fake.customers[first]["metadata"] == {"quilt_tenant_id": "ten-a"}


def test_a_double_send_is_caught_not_counted(fake, gateway):
    customer = _ready(fake, gateway)
    now = datetime.now(UTC)
    params = {"event_name": COST, "identifier": "id-1", "timestamp": int(now.timestamp()),
              "payload": {"stripe_customer_id": customer, "value": "7"}}
    gateway.client.v1.billing.meter_events.create(params=params)
    with pytest.raises(stripe.InvalidRequestError) as info:
        gateway.client.v1.billing.meter_events.create(params=params)  # no idempotency key: a true double send
    assert info.value.code == "resource_already_exists"
    assert fake.duplicate_identifiers == ["id-1"]
    assert fake.meter_totals() == {(customer, COST): 7}


def test_the_gateway_counts_a_known_identifier_as_acknowledged(fake, gateway):
    customer = _ready(fake, gateway)
    now = datetime.now(UTC)
    first = gateway.send_meter_event(identifier="id-2", event_name=COST, customer_id=customer, value=5, timestamp=now)
    again = gateway.send_meter_event(identifier="id-2", event_name=COST, customer_id=customer, value=5, timestamp=now)
    assert first.outcome == "accepted" and again.acknowledged
    assert fake.meter_totals() == {(customer, COST): 5}
    # the same identifier under another idempotency key reaches the identifier check
    fake._idempotency.clear()
    third = gateway.send_meter_event(identifier="id-2", event_name=COST, customer_id=customer, value=5, timestamp=now)
    assert third.outcome == "duplicate" and fake.meter_totals() == {(customer, COST): 5}


def test_stripe_refusals_are_classified(fake, gateway):
    customer = _ready(fake, gateway)
    old = datetime.now(UTC) - timedelta(days=36)
    assert gateway.send_meter_event(identifier="old", event_name=COST, customer_id=customer, value=1,
                                    timestamp=old).outcome == "failed"
    assert gateway.send_meter_event(identifier="who", event_name=COST, customer_id="cus_nobody", value=1,
                                    timestamp=datetime.now(UTC)).outcome == "failed"
    bad_key = StripeGateway(BillingSettings(stripe_api_base=fake.url, stripe_api_key="pk_wrong",
                                            stripe_max_network_retries=0))
    assert bad_key.send_meter_event(identifier="x", event_name=COST, customer_id=customer, value=1,
                                    timestamp=datetime.now(UTC)).outcome == "abort"
    down = StripeGateway(BillingSettings(stripe_api_base=f"http://127.0.0.1:{free_port()}",
                                         stripe_max_network_retries=0))
    assert down.send_meter_event(identifier="y", event_name=COST, customer_id=customer, value=1,
                                 timestamp=datetime.now(UTC)).outcome == "retry"


def test_meter_summaries(fake, gateway):
    customer = _ready(fake, gateway)
    meter_id = gateway.find_meters()[COST]
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    for i, value in enumerate((3, 4)):
        gateway.send_meter_event(identifier=f"s{i}", event_name=COST, customer_id=customer, value=value, timestamp=hour)
    assert gateway.meter_total(meter_id, customer, hour, hour + timedelta(hours=1)) == 7
    assert gateway.meter_total(meter_id, customer, hour + timedelta(hours=1), hour + timedelta(hours=2)) == 0
