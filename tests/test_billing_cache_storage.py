"""Prefix-cache hits and checkpoint storage, priced apart (issue 62 item 8): pure tables over
`billing.pricing` (the cached rate, sampling units from the engine's hits, storage per GB-month),
`billing.storage.storage_charges` (one idempotent ledger id per tenant, base and hour) and the
usage events the tinker SDK reads (`billing.usage.hourly_events`)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from billing.pricing import (
    Price,
    Units,
    cost_of,
    default_cached_rate,
    prompt_cache_hits,
    sampling_units,
    storage_cost,
    storage_units,
)
from billing.storage import MAX_CATCH_UP_HOURS, hour_of, hours_to_accrue, last_hour, storage_charges
from billing.usage import hourly_events

JAN = datetime(2026, 1, 1, tzinfo=UTC)
Q8B = Price("Qwen/Qwen3-8B", JAN, 195_000, 600_000, 440_000, id=1, storage_micro_usd_per_gb_month=100_000)
GB = 10**9


@pytest.mark.parametrize("prefill,cached", [
    (195_000, 39_000),  # 20% of the anchor's prefill rate
    (100_000, 20_000),
    (3, 1),             # 0.6 rounds half up
    (2, 0),             # 0.4 rounds down
    (0, 0),
])
def test_the_default_cached_rate_is_a_fifth_of_prefill(prefill, cached):
    assert default_cached_rate(prefill) == cached
    assert Price("b", JAN, prefill, 1, 1).rate("cached") == cached


def test_a_price_entry_may_name_its_own_cached_rate():
    assert Price("b", JAN, 100_000, 1, 1, cached_micro_usd_per_mtok=5_000).rate("cached") == 5_000
    assert Price("b", JAN, 100_000, 1, 1, cached_micro_usd_per_mtok=0).rate("cached") == 0


@pytest.mark.parametrize("prompt,hits,sampled,units", [
    (40, (0,), 5, Units(prefill_tokens=40, sample_tokens=5)),                    # a first prompt: nothing cached
    (40, (32,), 5, Units(prefill_tokens=8, cached_tokens=32, sample_tokens=5)),  # the same prompt again
    (40, (0, 0, 0), 9, Units(prefill_tokens=40, cached_tokens=80, sample_tokens=9)),  # n=3 started together: one prefill
    (40, (32, 0, 0), 9, Units(prefill_tokens=8, cached_tokens=112, sample_tokens=9)),  # the prompt seen before
    (40, (0, 32, 32), 9, Units(prefill_tokens=8, cached_tokens=112, sample_tokens=9)),  # whichever sequence hit
    (40, (99,), 1, Units(cached_tokens=40, sample_tokens=1)),                    # a count past the prompt is capped
    (40, (-3,), 1, Units(prefill_tokens=40, sample_tokens=1)),                   # and a negative one is none
    (0, (0, 0), 0, Units()),
])
def test_sampling_units_split_the_prompt_by_the_engines_hits(prompt, hits, sampled, units):
    assert sampling_units(prompt, hits, sampled) == units


@pytest.mark.parametrize(("prompt", "hits", "reported"), [
    (40, (), 0), (40, (0, 0, 0), 0), (40, (32,), 32), (40, (0, 32, 31), 32), (40, (99, 0), 40), (40, (-3,), 0),
])
def test_the_sdk_is_told_the_prompts_hits_once_per_request(prompt, hits, reported):
    assert prompt_cache_hits(prompt, hits) == reported


def test_cached_tokens_cost_a_fifth_of_prefill_and_each_unit_rounds_apart():
    million = 1_000_000
    cost = cost_of(Units(prefill_tokens=million, cached_tokens=million), Q8B)
    assert (cost.prefill_micro_usd, cost.cached_micro_usd) == (195_000, 39_000)
    assert cost.total_micro_usd == 234_000
    # A repeated prompt of 1,000 tokens, 992 of them hits: 8 at 0.195 and 992 at 0.039 per million.
    again = cost_of(sampling_units(1000, (992,), 0), Q8B)
    assert (again.prefill_micro_usd, again.cached_micro_usd) == (2, 39)  # 1.56 and 38.688


@pytest.mark.parametrize("byte_hours,rate,micro", [
    (GB * 720, 100_000, 100_000),  # one GB for a month at $0.10
    (GB, 100_000, 139),            # one GB-hour: 138.89
    (GB, 0, 0),                    # a free storage rate
    (3_600_000, 100_000, 1),       # 3.6 MB for an hour: 0.5 micro-USD rounds up
    (3_599_999, 100_000, 0),       # and just under it down
    (10**6 * 3600, 100_000, 500),  # 3.6 GB-hours: exactly 500
    (0, 100_000, 0),
])
def test_storage_cost_per_gb_month(byte_hours, rate, micro):
    assert storage_cost(byte_hours, rate) == micro


def test_storage_is_on_the_same_cost_as_tokens_and_needs_a_price():
    cost = cost_of(storage_units(2 * GB) + Units(train_tokens=1_000_000), Q8B)
    assert (cost.storage_micro_usd, cost.train_micro_usd, cost.total_micro_usd) == (278, 440_000, 440_278)
    assert cost_of(storage_units(2 * GB, hours=720), Q8B).storage_micro_usd == 200_000
    assert cost_of(storage_units(GB), None).total_micro_usd == 0
    assert not storage_units(GB).empty and storage_units(0).empty


H = datetime(2026, 3, 4, 5, tzinfo=UTC)


@pytest.mark.parametrize("live,charges", [
    ([], []),
    ([{"tenant_id": "t1", "base_model": "b", "size_bytes": 10}],
     [("storage:t1:b:2026-03-04T05", "t1", "b", 10)]),
    # bytes add per tenant and base; empty ones are not billed; order does not matter
    ([{"tenant_id": "t2", "base_model": "b", "size_bytes": 5}, {"tenant_id": "t1", "base_model": "c", "size_bytes": 0},
      {"tenant_id": "t1", "base_model": "b", "size_bytes": 7}, {"tenant_id": "t2", "base_model": "b", "size_bytes": 6}],
     [("storage:t1:b:2026-03-04T05", "t1", "b", 7), ("storage:t2:b:2026-03-04T05", "t2", "b", 11)]),
])
def test_storage_charges_one_per_tenant_base_and_hour(live, charges):
    got = storage_charges(live, H)
    assert [(c.ledger_id, c.tenant_id, c.base_model, c.units.storage_byte_hours) for c in got] == charges
    # The same hour gives the same ids (the ledger keeps the first); the next hour new ones.
    assert [c.ledger_id for c in storage_charges(live, H)] == [c[0] for c in charges]
    assert not {c.ledger_id for c in storage_charges(live, H + timedelta(hours=1))} & {c[0] for c in charges}


def test_a_storage_period_starts_on_an_hour():
    with pytest.raises(ValueError, match="UTC hour"):
        storage_charges([], H + timedelta(minutes=1))
    assert hour_of(H + timedelta(minutes=59)) == H
    assert last_hour(H + timedelta(minutes=2)) == H - timedelta(hours=1)


def _h(n: int) -> datetime:
    return H + timedelta(hours=n)


@pytest.mark.parametrize(("newest", "now", "hours"), [
    (None, _h(0) + timedelta(minutes=2), [_h(-1)]),  # nothing billed yet: the last hour only
    (_h(-2), _h(0) + timedelta(minutes=2), [_h(-1)]),  # on time
    (_h(-1), _h(0) + timedelta(minutes=2), []),  # that hour is billed already
    (_h(-1), _h(0) + timedelta(minutes=59), []),
    (_h(-4), _h(0) + timedelta(minutes=2), [_h(-3), _h(-2), _h(-1)]),  # beat was down three hours
    (_h(-2), _h(1) + timedelta(minutes=30), [_h(-1), _h(0)]),  # ran late: the skipped hour too
    (_h(-1000), _h(0), [_h(-MAX_CATCH_UP_HOURS + i) for i in range(MAX_CATCH_UP_HOURS)]),  # capped
    (_h(3), _h(0), []),  # a clock that went back bills nothing twice
])
def test_missed_storage_hours_are_accrued_from_the_newest_billed_one(newest, now, hours):
    assert hours_to_accrue(newest, now) == hours


def test_usage_events_show_cached_prefill_and_storage_as_the_sdk_reads_them():
    from tinker import types

    row = {"hour": H, "base_model": "b", "session_id": "s", "key_prefix": "k", "key_name": "",
           "prefill_tokens": 8, "prefill_micro_usd": 2, "cached_tokens": 992, "cached_micro_usd": 39,
           "sample_tokens": 0, "sample_micro_usd": 0, "train_tokens": 0, "train_micro_usd": 0,
           "storage_byte_hours": 36 * 10**8, "storage_micro_usd": 500}
    events = hourly_events([row])
    parsed = [types.BillingUsageEvent.model_validate({**e, "user_id": e.pop("key_prefix")}) for e in events]
    kinds = {(e.event_info.type, getattr(e.event_info, "cached", None)): e for e in parsed}
    assert kinds[("sampling_prefill", True)].event_info.token_count == 992
    assert kinds[("sampling_prefill", False)].event_info.token_count == 8
    storage = kinds[("storage", None)]
    assert storage.event_info.gigabyte_hours == pytest.approx(3.6) and not storage.event_info.free
    assert storage.estimated_cost_usd == pytest.approx(storage.effective_rate_usd_per_gigabyte_month * 3.6 / 720)
    assert storage.effective_rate_usd_per_gigabyte_month == pytest.approx(0.1)
    # Rows from before these units (no such keys) give token events only.
    old = {k: v for k, v in row.items() if not k.startswith(("cached", "storage"))}
    assert {e["event_info"]["type"] for e in hourly_events([old])} == {"sampling_prefill"}
