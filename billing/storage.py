"""Checkpoint storage on the ledger: each hour, every tenant's live checkpoint bytes per base model
are billed for that hour, at the base's storage rate (`billing.pricing.storage_cost`, per GB-month).

`storage_charges` is pure (live bytes in, ledger charges out). `accrue` reads the bytes and writes
the charges; each charge's ledger id names the tenant, base and hour (`storage:<tenant>:<base>:<hour>`),
and the ledger is unique on it, so accruing an hour twice, or from two Celery workers at once,
bills it once. The bytes are those live when the hour is accrued (just after it ends, or later for an
hour missed: `hours_to_accrue`) and saved before it ended: a checkpoint saved and deleted within one
hour is not billed, one kept across it is billed for the whole hour. Each charge is dated at the
start of the hour it bills, so every rollup puts it in that hour's day and month.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import psycopg
from psycopg.rows import DictRow, dict_row

from billing.ledger import record_usage
from billing.pricing import Units, storage_units
from checkpoints import retention


@dataclass(frozen=True)
class StorageCharge:
    ledger_id: str
    tenant_id: str
    base_model: str
    units: Units


def hour_of(at: datetime) -> datetime:
    """The UTC hour `at` falls in."""
    return at.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def storage_charges(live: list[dict], hour: datetime) -> list[StorageCharge]:
    """One charge per (tenant_id, base_model) with bytes among `live` rows ({tenant_id, base_model,
    size_bytes}), for the hour starting at `hour` (on a UTC hour)."""
    if hour != hour_of(hour):
        raise ValueError(f"a storage period starts on a UTC hour, got {hour.isoformat()}")
    total: dict[tuple[str, str], int] = {}
    for r in live:
        key = (r["tenant_id"], r["base_model"])
        total[key] = total.get(key, 0) + max(int(r["size_bytes"]), 0)
    stamp = hour.astimezone(UTC).strftime("%Y-%m-%dT%H")
    return [StorageCharge(f"storage:{tenant}:{base}:{stamp}", tenant, base, storage_units(size))
            for (tenant, base), size in sorted(total.items()) if size > 0]


# A tenant's live checkpoint files, each directory once: copies inside a tenant (copy_weights, the
# rows of status `copy`) name the same files, and the bytes are stored once (the quota counts them
# so too, tenancy.sharing). A copy in another tenant is that tenant's storage as well.
def _live_files(where: str = "true") -> str:
    return f"""
SELECT DISTINCT ON (c.tenant_id, c.storage_path) c.tenant_id, m.base_model, c.size_bytes
FROM checkpoints c JOIN training_models m ON m.id = c.model_id
WHERE {retention.LIVE} AND {where}
ORDER BY c.tenant_id, c.storage_path, c.id
"""


_LIVE_FILES = _live_files()

# An hour accrued late (`hours_to_accrue`) bills only the checkpoints saved before it ended (a
# version saved since, which replaced an older one in its row, is billed from its own save on).
_LIVE_BYTES = f"""
SELECT tenant_id, base_model, sum(size_bytes)::bigint AS size_bytes
FROM ({_live_files("c.created_at < %(hour_end)s")}) f
GROUP BY tenant_id, base_model
"""


def accrue(conn: psycopg.Connection[DictRow], hour: datetime) -> int:
    """Bill the hour starting at `hour` for every tenant's live checkpoints; returns how many
    charges were new (0 when the hour was accrued before)."""
    with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
        charges = storage_charges(cur.execute(_LIVE_BYTES, {"hour_end": hour + timedelta(hours=1)}).fetchall(), hour)
        return sum(record_usage(conn, request_id=c.ledger_id, tenant_id=c.tenant_id, api_key_id=None, model_id=None,
                                base_model=c.base_model, units=c.units, billed_at=hour) is not None for c in charges)


def last_hour(now: datetime) -> datetime:
    """The hour that ended last before `now`: the newest one the hourly task accrues."""
    return hour_of(now) - timedelta(hours=1)


# Hours missed (beat down, a worker late) are accrued when the task next runs, back to this many;
# older ones are given up on (a platform down for days bills the days it was down not at all).
MAX_CATCH_UP_HOURS = 7 * 24


def hours_to_accrue(newest_accrued: datetime | None, now: datetime, *, most: int = MAX_CATCH_UP_HOURS) -> list[datetime]:
    """The hours the task accrues at `now`, oldest first: each one after `newest_accrued` (the
    newest hour on the ledger's `storage:` rows; None: none yet, so the last hour only) up to
    `last_hour(now)`, at most `most` of them (the newest). Each is billed with the bytes live when
    it is accrued: a missed hour is billed late rather than never."""
    last = last_hour(now)
    first = last if newest_accrued is None else max(hour_of(newest_accrued) + timedelta(hours=1),
                                                    last - timedelta(hours=most - 1))
    count = int((last - first) / timedelta(hours=1)) + 1
    return [first + timedelta(hours=i) for i in range(max(count, 0))]


def newest_accrued_hour(conn: psycopg.Connection[DictRow]) -> datetime | None:
    """The newest hour any storage charge bills (its ledger row is dated at the hour's start)."""
    row = conn.execute("SELECT max(created_at) AS hour FROM usage_ledger WHERE storage_byte_hours > 0").fetchone()
    return None if row is None else row["hour"]


_TENANT_RATE = f"""
SELECT sum(f.size_bytes)::bigint AS size_bytes,
       sum(f.size_bytes * COALESCE(p.storage_micro_usd_per_gb_month, 0))::numeric AS weighted
FROM ({_LIVE_FILES}) f
LEFT JOIN LATERAL (SELECT storage_micro_usd_per_gb_month FROM price_book
                   WHERE base_model = f.base_model AND effective_from <= now()
                   ORDER BY effective_from DESC LIMIT 1) p ON true
WHERE f.tenant_id = %s
"""


async def tenant_rate_micro_usd_per_gb_month(conn, tenant_id: str) -> float:
    """The storage rate in force for a tenant's live checkpoints, weighted by their bytes (each
    base's rate; one number when, as by default, every base has the same one). With no bytes,
    the default rate of the price book's newest entries."""
    row = await (await conn.execute(_TENANT_RATE, (tenant_id,))).fetchone()
    if row and row["size_bytes"]:
        return float(row["weighted"]) / row["size_bytes"]
    row = await (await conn.execute("SELECT storage_micro_usd_per_gb_month AS rate FROM price_book "
                                    "WHERE effective_from <= now() ORDER BY effective_from DESC LIMIT 1")).fetchone()
    return float(row["rate"]) if row else 0.0
