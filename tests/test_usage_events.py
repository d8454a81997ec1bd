"""Hourly usage events (the tinker SDK's `get_billing_usage`) as pure functions: the report window's
bounds and the ledger's grouped rows turned into events."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from billing.usage import event_window, hourly_events, within_report_limit
from core.errors import InvalidInput

NOW = datetime(2026, 12, 4, 13, 47, tzinfo=UTC)
HOUR = datetime(2026, 12, 4, 13, tzinfo=UTC)


@pytest.mark.parametrize("start,end,want", [
    (HOUR, HOUR + timedelta(hours=1), (HOUR, HOUR + timedelta(hours=1))),
    # A time without a zone is UTC; another zone is converted (10:00+05:30 is not on a UTC hour,
    # 18:30+05:30 is 13:00 UTC).
    (HOUR.replace(tzinfo=None), HOUR.replace(tzinfo=None) + timedelta(days=14),
     (HOUR, HOUR + timedelta(days=14))),
    (datetime(2026, 12, 4, 18, 30, tzinfo=timezone(timedelta(hours=5, minutes=30))), HOUR + timedelta(hours=2),
     (HOUR, HOUR + timedelta(hours=2))),
    # The end may lie ahead: only the start must have begun.
    (HOUR, HOUR + timedelta(days=3), (HOUR, HOUR + timedelta(days=3))),
])
def test_windows_taken(start, end, want):
    assert event_window(start, end, NOW) == want


@pytest.mark.parametrize("start,end,field,words", [
    (HOUR + timedelta(minutes=30), HOUR + timedelta(hours=2), "starting_on", "on a UTC hour"),
    (HOUR, HOUR + timedelta(hours=1, seconds=1), "ending_before", "on a UTC hour"),
    (HOUR.replace(microsecond=1), HOUR + timedelta(hours=1), "starting_on", "on a UTC hour"),
    (datetime(2026, 12, 4, 10, tzinfo=timezone(timedelta(hours=5, minutes=30))), HOUR, "starting_on",
     "on a UTC hour"),
    (HOUR + timedelta(hours=1), HOUR + timedelta(hours=2), "starting_on", "in the future"),
    (HOUR, HOUR, "ending_before", "must be after"),
    (HOUR, HOUR - timedelta(hours=1), "ending_before", "must be after"),
    (HOUR, HOUR + timedelta(days=14, hours=1), "ending_before", "at most 14 days"),
    # Zones that carry the time out of what a datetime holds.
    (datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-5))), HOUR, "starting_on", "out of range"),
    (HOUR, datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=5))), "ending_before", "out of range"),
])
def test_windows_refused_name_the_field(start, end, field, words):
    with pytest.raises(InvalidInput) as refused:
        event_window(start, end, NOW)
    assert refused.value.field == field and words in str(refused.value)


def _row(hour=HOUR, *, session="sess-a", key="tml-abc", prefill=0, sample=0, train=0, prefill_usd=0, sample_usd=0,
         train_usd=0) -> dict:
    return {"hour": hour, "base_model": "quilt/tiny-qwen3", "session_id": session, "key_prefix": key,
            "key_name": "ci", "prefill_tokens": prefill, "sample_tokens": sample, "train_tokens": train,
            "prefill_micro_usd": prefill_usd, "sample_micro_usd": sample_usd, "train_micro_usd": train_usd}


def test_one_event_per_unit_with_tokens_ordered_by_hour_then_tokens():
    later = HOUR + timedelta(hours=1)
    rows = [_row(later, train=10, train_usd=2), _row(prefill=300, sample=40, prefill_usd=60, sample_usd=24),
            _row(session=None, key=None, sample=500, sample_usd=300)]
    events = hourly_events(rows)
    assert [(e["bucket_start"], e["event_info"]["type"], e["event_info"]["token_count"]) for e in events] == [
        (HOUR, "sampling_sample", 500), (HOUR, "sampling_prefill", 300), (HOUR, "sampling_sample", 40),
        (later, "training", 10)]
    first = events[0]
    assert first["bucket_end"] == HOUR + timedelta(hours=1)
    assert first["session_id"] is None and first["key_prefix"] is None
    assert first["estimated_cost_usd"] == 0.0003
    assert first["effective_rate_usd_per_million_tokens"] == 0.6  # 300 micro-USD for 500 tokens: $0.60 per M
    assert events[1]["event_info"] == {"type": "sampling_prefill", "cached": False, "token_count": 300}


def test_rows_without_tokens_give_no_events_and_buckets_are_utc():
    # optim_step and saves are ledger rows at zero tokens; the hour may come back in another zone.
    east = HOUR.astimezone(timezone(timedelta(hours=9)))
    assert hourly_events([_row()]) == []
    (event,) = hourly_events([_row(east, train=7, train_usd=0)])
    assert event["bucket_start"] == HOUR and event["bucket_start"].tzinfo == UTC
    assert event["estimated_cost_usd"] == 0.0 and event["effective_rate_usd_per_million_tokens"] == 0.0


def test_a_report_past_its_row_limit_is_refused_with_an_end_that_fits():
    rows = [_row(HOUR + timedelta(hours=h), session=f"s{h}-{i}", train=1) for h in range(3) for i in range(2)]
    assert within_report_limit(rows, HOUR, limit=6) == rows
    with pytest.raises(InvalidInput) as err:  # rows[3] starts the second hour: end there
        within_report_limit(rows, HOUR, limit=3)
    assert err.value.field == "ending_before"
    assert "more than 3 hourly usage rows" in str(err.value)
    assert f"ending_before={(HOUR + timedelta(hours=1)).isoformat()}" in str(err.value)
    with pytest.raises(InvalidInput) as err:  # the first hour alone is past the limit
        within_report_limit(rows, HOUR, limit=1)
    assert "that hour alone" in str(err.value) and "/api/v1/quilt/usage" in str(err.value)
