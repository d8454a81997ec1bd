"""Usage reports: spend by day, by model and by unit, from the daily rollup of the ledger; and
hourly usage events per session and key, from the ledger's hourly rollup by session
(`usage_hourly_sessions`), in the shape of the tinker SDK's `BillingUsageResponse`.

`summarize` and `hourly_events` are pure (rows in, report out); `report` / `report_sync` and
`usage_events` fetch the rows for the API and the CLI.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any

import psycopg
from psycopg.rows import DictRow, dict_row

from billing.pricing import BYTES_PER_GB, HOURS_PER_MONTH, MICRO_PER_USD, UNITS, usd
from core.errors import InvalidInput

_ROWS = """
SELECT day, base_model,
       sum(requests)::bigint AS requests,
       sum(prefill_tokens)::bigint AS prefill_tokens, sum(sample_tokens)::bigint AS sample_tokens,
       sum(train_tokens)::bigint AS train_tokens,
       sum(prefill_micro_usd)::bigint AS prefill_micro_usd, sum(sample_micro_usd)::bigint AS sample_micro_usd,
       sum(train_micro_usd)::bigint AS train_micro_usd, sum(cost_micro_usd)::bigint AS cost_micro_usd,
       sum(cached_tokens)::bigint AS cached_tokens, sum(cached_micro_usd)::bigint AS cached_micro_usd,
       sum(storage_byte_hours)::bigint AS storage_byte_hours, sum(storage_micro_usd)::bigint AS storage_micro_usd
FROM usage_daily
WHERE tenant_id = %s AND day >= %s AND day < %s
GROUP BY day, base_model ORDER BY day, base_model
"""

_NUMBERS = ("requests", "prefill_tokens", "sample_tokens", "train_tokens", "cached_tokens", "storage_byte_hours",
            "prefill_micro_usd", "sample_micro_usd", "train_micro_usd", "cached_micro_usd", "storage_micro_usd",
            "cost_micro_usd")


def _zero() -> dict:
    return dict.fromkeys(_NUMBERS, 0)


def _add(into: dict, row: dict) -> None:
    for k in _NUMBERS:
        into[k] += int(row[k])


@dataclass
class UsageSummary:
    """Spend between `since` (inclusive) and `until` (exclusive), UTC days."""

    since: date
    until: date
    rows: list[dict] = field(default_factory=list)  # one per (day, base_model)
    by_day: dict[date, dict] = field(default_factory=dict)
    by_model: dict[str, dict] = field(default_factory=dict)
    total: dict = field(default_factory=_zero)

    def by_unit(self) -> list[dict]:
        """The token units, then checkpoint storage (in GB-hours, not tokens)."""
        tokens = [{"unit": u, "tokens": self.total[f"{u}_tokens"], "cost_micro_usd": self.total[f"{u}_micro_usd"],
                   "cost_usd": usd(self.total[f"{u}_micro_usd"])} for u in UNITS]
        storage = self.total["storage_micro_usd"]
        return [*tokens, {"unit": "storage", "tokens": 0, "gigabyte_hours": self.total["storage_byte_hours"] / BYTES_PER_GB,
                          "cost_micro_usd": storage, "cost_usd": usd(storage)}]

    def to_json(self) -> dict:
        def money(d: dict) -> dict:
            return {**d, "cost_usd": usd(d["cost_micro_usd"])}

        return {
            "since": self.since.isoformat(),
            "until": self.until.isoformat(),
            "total_micro_usd": self.total["cost_micro_usd"],
            "total_usd": usd(self.total["cost_micro_usd"]),
            "by_day": [money({"day": d.isoformat(), **v}) for d, v in self.by_day.items()],
            "by_model": [money({"base_model": m, **v}) for m, v in self.by_model.items()],
            "by_unit": self.by_unit(),
            "rows": [money({**r, "day": r["day"].isoformat()}) for r in self.rows],
        }


def summarize(rows: list[dict], since: date, until: date) -> UsageSummary:
    """Group (day, base_model) rows by day, by model and in total."""
    out = UsageSummary(since, until)
    for r in rows:
        row = {"day": r["day"], "base_model": r["base_model"], **{k: int(r[k]) for k in _NUMBERS}}
        out.rows.append(row)
        _add(out.by_day.setdefault(r["day"], _zero()), row)
        _add(out.by_model.setdefault(r["base_model"], _zero()), row)
        _add(out.total, row)
    out.by_model = dict(sorted(out.by_model.items(), key=lambda kv: -kv[1]["cost_micro_usd"]))
    return out


async def report(conn, tenant_id: str, since: date, until: date) -> UsageSummary:
    cur = await conn.execute(_ROWS, (tenant_id, since, until))
    return summarize(await cur.fetchall(), since, until)


def report_sync(conn: psycopg.Connection[DictRow], tenant_id: str, since: date, until: date) -> UsageSummary:
    with conn.cursor(row_factory=dict_row) as cur:
        return summarize(cur.execute(_ROWS, (tenant_id, since, until)).fetchall(), since, until)


MAX_EVENT_WINDOW = timedelta(days=14)
# One report's rows: each gives up to three events of a few hundred bytes, so at most a few MB.
MAX_EVENT_ROWS = 5_000


def event_window(starting_on: datetime, ending_before: datetime, now: datetime) -> tuple[datetime, datetime]:
    """[start, end) of an hourly usage report, in UTC, as the tinker SDK's `GetBillingUsageRequest`
    bounds it: both on a UTC hour, the start not in the future, the end after it and at most 14 days
    later. A time without a zone is UTC. Refusals name the field (InvalidInput)."""
    bounds = {}
    for name, value in (("starting_on", starting_on), ("ending_before", ending_before)):
        try:
            value = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
        except OverflowError:  # a zone that moves the time past year 1 or 9999
            raise InvalidInput(f"{name} {value.isoformat()} is out of range", field=name) from None
        if value != value.replace(minute=0, second=0, microsecond=0):
            raise InvalidInput(f"{name} must be on a UTC hour (minutes, seconds zero), got {value.isoformat()}",
                               field=name)
        bounds[name] = value
    start, end = bounds["starting_on"], bounds["ending_before"]
    if start > now:
        raise InvalidInput(f"starting_on {start.isoformat()} is in the future", field="starting_on")
    if end <= start:
        raise InvalidInput(f"ending_before ({end.isoformat()}) must be after starting_on ({start.isoformat()})",
                           field="ending_before")
    if end - start > MAX_EVENT_WINDOW:
        raise InvalidInput(f"a report spans at most {MAX_EVENT_WINDOW.days} days; ending_before is "
                           f"{end - start} after starting_on", field="ending_before")
    return start, end


# The hourly rollup by session and key (usage_hourly_sessions, written with the ledger).
_HOURLY = """
SELECT u.hour, u.base_model, NULLIF(u.session_id, '') AS session_id, k.prefix AS key_prefix, k.name AS key_name,
       u.prefill_tokens, u.sample_tokens, u.train_tokens, u.prefill_micro_usd, u.sample_micro_usd, u.train_micro_usd,
       u.cached_tokens, u.cached_micro_usd, u.storage_byte_hours, u.storage_micro_usd
FROM usage_hourly_sessions u LEFT JOIN api_keys k ON k.id = NULLIF(u.api_key_id, '')
WHERE u.tenant_id = %s AND u.hour >= %s AND u.hour < %s
ORDER BY u.hour LIMIT %s
"""

# Quilt's units as tinker's event types. Prefill is every token read without training on it: sampling
# prompts and `forward` passes, both at the prefill rate; prompt tokens the engine found in its
# prefix cache are the cached unit, at its own rate. Storage is the fourth kind (`storage_event`).
_EVENT_OF_UNIT: dict[str, dict[str, Any]] = {
    "train": {"type": "training"}, "prefill": {"type": "sampling_prefill", "cached": False},
    "cached": {"type": "sampling_prefill", "cached": True}, "sample": {"type": "sampling_sample"}}


def within_report_limit(rows: list[dict], start: datetime, limit: int = MAX_EVENT_ROWS) -> list[dict]:
    """The rows of a report (ordered by hour) when there are at most `limit`; otherwise a refusal
    naming `ending_before` and the latest end whose report fits. tinker has no paging for this
    report, so a window is what bounds the answer."""
    if len(rows) <= limit:
        return rows
    first_over = rows[limit]["hour"].astimezone(UTC)
    if first_over > start:
        fix = f"ask up to ending_before={first_over.isoformat()} and go on from there"
    else:
        fix = "that hour alone holds more: GET /api/v1/quilt/usage gives the same usage by day and base model"
    raise InvalidInput(f"this window holds more than {limit:,} hourly usage rows (one per base model, session "
                       f"and key with usage in an hour); {fix}", field="ending_before")


def hourly_events(rows: list[dict]) -> list[dict]:
    """One event per (hour, base model, session, key) and unit with tokens, ordered by hour, then
    most tokens first: tinker's `BillingUsageEvent`, with the key's prefix (`key_prefix`) in place
    of `user_id`. Costs are the ledger's: what each request was billed, before credits."""
    events = []
    for r in rows:
        start = r["hour"].astimezone(UTC)
        envelope = {"bucket_start": start, "bucket_end": start + timedelta(hours=1), "base_model": r["base_model"],
                    "session_id": r["session_id"], "key_prefix": r["key_prefix"], "user_name": r["key_name"] or None}
        for unit, info in _EVENT_OF_UNIT.items():
            tokens, micro_usd = int(r.get(f"{unit}_tokens") or 0), int(r.get(f"{unit}_micro_usd") or 0)
            if tokens == 0:
                continue
            events.append({
                **envelope, "estimated_cost_usd": micro_usd / MICRO_PER_USD,
                # USD per million tokens: micro-USD per token.
                "effective_rate_usd_per_million_tokens": micro_usd / tokens,
                "event_info": {**info, "token_count": tokens},
            })
        if int(r.get("storage_byte_hours") or 0):
            events.append({**envelope, **storage_event(int(r["storage_byte_hours"]), int(r["storage_micro_usd"]))})
    events.sort(key=lambda e: (e["bucket_start"], -e["event_info"].get("token_count", 0)))
    return events


def storage_event(byte_hours: int, micro_usd: int) -> dict:
    """tinker's storage event body: GB-hours and their cost, with the rate they came to per
    GB-month (720 GB-hours), as the SDK computes `estimated_cost_usd` from them."""
    gb_hours = byte_hours / BYTES_PER_GB
    return {"estimated_cost_usd": micro_usd / MICRO_PER_USD,
            "effective_rate_usd_per_gigabyte_month": micro_usd / MICRO_PER_USD * HOURS_PER_MONTH / gb_hours,
            "event_info": {"type": "storage", "free": micro_usd == 0, "gigabyte_hours": gb_hours}}


async def usage_events(conn, tenant_id: str, start: datetime, end: datetime) -> tuple[list[dict], dict[str, dict]]:
    """The tenant's hourly events in [start, end), and the `user_metadata` of each session in them."""
    rows = await (await conn.execute(_HOURLY, (tenant_id, start, end, MAX_EVENT_ROWS + 1))).fetchall()
    events = hourly_events(within_report_limit(rows, start))
    session_ids = sorted({e["session_id"] for e in events if e["session_id"]})
    cur = await conn.execute("SELECT id, user_metadata FROM sessions WHERE tenant_id = %s AND id = ANY(%s)",
                             (tenant_id, session_ids))
    return events, {r["id"]: r["user_metadata"] for r in await cur.fetchall()}
