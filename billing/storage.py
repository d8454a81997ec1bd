"""Checkpoint storage on the ledger: each hour, every tenant's live checkpoint bytes per base model
are billed for that hour, at the base's storage rate (`billing.pricing.storage_cost`, per GB-month).

`storage_charges` is pure (live bytes in, ledger charges out). `accrue` reads the bytes and writes
the charges; each charge's ledger id names the tenant, base and hour (`storage:<tenant>:<base>:<hour>`),
and the ledger is unique on it, so accruing an hour twice, or from two Celery workers at once,
bills it once. The bytes are those live when the hour is accrued (just after it ends): a checkpoint
saved and deleted within one hour is not billed, one kept across it is billed for the whole hour.
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
_LIVE_FILES = f"""
SELECT DISTINCT ON (c.tenant_id, c.storage_path) c.tenant_id, m.base_model, c.size_bytes
FROM checkpoints c JOIN training_models m ON m.id = c.model_id
WHERE {retention.LIVE}
ORDER BY c.tenant_id, c.storage_path, c.id
"""

_LIVE_BYTES = f"""
SELECT tenant_id, base_model, sum(size_bytes)::bigint AS size_bytes FROM ({_LIVE_FILES}) f
GROUP BY tenant_id, base_model
"""


def accrue(conn: psycopg.Connection[DictRow], hour: datetime) -> int:
    """Bill the hour starting at `hour` for every tenant's live checkpoints; returns how many
    charges were new (0 when the hour was accrued before)."""
    with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
        charges = storage_charges(cur.execute(_LIVE_BYTES).fetchall(), hour)
        return sum(record_usage(conn, request_id=c.ledger_id, tenant_id=c.tenant_id, api_key_id=None, model_id=None,
                                base_model=c.base_model, units=c.units) is not None for c in charges)


def last_hour(now: datetime) -> datetime:
    """The hour that ended last before `now`: what the hourly task accrues."""
    return hour_of(now) - timedelta(hours=1)


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
