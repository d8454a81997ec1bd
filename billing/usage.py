"""Usage reports: spend by day, by model and by unit, from the daily rollup of the ledger.

`summarize` is pure (rows in, report out); `report` / `report_sync` fetch the rows for the API and
the CLI.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date

import psycopg
from psycopg.rows import dict_row

from billing.pricing import UNITS, usd

_ROWS = """
SELECT day, base_model,
       sum(requests)::bigint AS requests,
       sum(prefill_tokens)::bigint AS prefill_tokens, sum(sample_tokens)::bigint AS sample_tokens,
       sum(train_tokens)::bigint AS train_tokens,
       sum(prefill_micro_usd)::bigint AS prefill_micro_usd, sum(sample_micro_usd)::bigint AS sample_micro_usd,
       sum(train_micro_usd)::bigint AS train_micro_usd, sum(cost_micro_usd)::bigint AS cost_micro_usd
FROM usage_daily
WHERE tenant_id = %s AND day >= %s AND day < %s
GROUP BY day, base_model ORDER BY day, base_model
"""

_NUMBERS = ("requests", "prefill_tokens", "sample_tokens", "train_tokens", "prefill_micro_usd",
            "sample_micro_usd", "train_micro_usd", "cost_micro_usd")


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
        return [{"unit": u, "tokens": self.total[f"{u}_tokens"], "cost_micro_usd": self.total[f"{u}_micro_usd"],
                 "cost_usd": usd(self.total[f"{u}_micro_usd"])} for u in UNITS]

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


def report_sync(conn: psycopg.Connection, tenant_id: str, since: date, until: date) -> UsageSummary:
    with conn.cursor(row_factory=dict_row) as cur:
        return summarize(cur.execute(_ROWS, (tenant_id, since, until)).fetchall(), since, until)
