"""The price book: per base model, rates in micro-USD per million tokens, with effective dates.

Entries are never edited: a new price is a new row with a later `effective_from`, and ledger rows
point at the entry they were priced with.
"""

from __future__ import annotations

from datetime import datetime

import psycopg
from psycopg.rows import DictRow, dict_row
from psycopg.types.json import Jsonb

from billing.pricing import Price, check_context_tiers, size_rates
from core import db

_COLUMNS = ("id, base_model, effective_from, prefill_micro_usd_per_mtok, sample_micro_usd_per_mtok, "
            "train_micro_usd_per_mtok, note, cached_micro_usd_per_mtok, storage_micro_usd_per_gb_month, context_tiers")

_CURRENT_ONE = f"""
SELECT {_COLUMNS} FROM price_book
WHERE base_model = %s AND effective_from <= now()
ORDER BY effective_from DESC LIMIT 1
"""

_CURRENT_ALL = f"""
SELECT DISTINCT ON (base_model) {_COLUMNS} FROM price_book
WHERE effective_from <= now()
ORDER BY base_model, effective_from DESC
"""

_ALL = f"SELECT {_COLUMNS} FROM price_book ORDER BY base_model, effective_from"


def _price(row: dict) -> Price:
    return Price(**{**row, "context_tiers": tuple(tuple(t) for t in row.get("context_tiers") or ())})


def current_price_sync(conn: psycopg.Connection[DictRow], base_model: str) -> Price | None:
    """The entry in force now (the transaction's `now()`) for a base model, or None."""
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(_CURRENT_ONE, (base_model,)).fetchone()
    return _price(row) if row else None


def list_prices_sync(conn: psycopg.Connection[DictRow]) -> list[Price]:
    with conn.cursor(row_factory=dict_row) as cur:
        return [_price(r) for r in cur.execute(_ALL).fetchall()]


def add_price(conn: psycopg.Connection[DictRow], *, base_model: str, effective_from: datetime, prefill: int, sample: int,
              train: int, note: str = "", cached: int | None = None, storage: int | None = None,
              context_tiers: tuple | list = ()) -> Price:
    """Add an entry (token rates in micro-USD per million tokens; `cached` None = 20% of prefill;
    `storage` in micro-USD per GB-month, None = the table's default; `context_tiers` [[above_tokens,
    percent], ...], checked by billing.pricing.check_context_tiers). Raises if one already starts then."""
    tiers = check_context_tiers(list(context_tiers))
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(
            f"INSERT INTO price_book (base_model, effective_from, prefill_micro_usd_per_mtok, "
            f"sample_micro_usd_per_mtok, train_micro_usd_per_mtok, note, cached_micro_usd_per_mtok, context_tiers, "
            f"storage_micro_usd_per_gb_month) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, "
            # the column's default (migration 0028) when no storage rate is given
            f"{'DEFAULT' if storage is None else '%s'}) RETURNING {_COLUMNS}",
            (base_model, effective_from, prefill, sample, train, note, cached, Jsonb([list(t) for t in tiers]),
             *(() if storage is None else (storage,))),
        ).fetchone()
    return _price(db.one(row))


async def list_prices(conn) -> list[Price]:
    """Every entry, past, current and scheduled, ordered by model then date."""
    cur = await conn.execute(_ALL)
    return [_price(r) for r in await cur.fetchall()]


async def current_prices(conn) -> dict[str, Price]:
    """The entry in force now for every priced base model."""
    cur = await conn.execute(_CURRENT_ALL)
    return {r["base_model"]: _price(r) for r in await cur.fetchall()}


def ensure_size_price(conn: psycopg.Connection[DictRow], base) -> Price:
    """The price in force for a catalogue base (bases.catalog.BaseModel); one from its size
    (billing.pricing.size_rates) is added, effective now, when it has none."""
    price = current_price_sync(conn, base.name)
    if price is not None:
        return price
    rates = size_rates(base.num_parameters, base.active_parameters or base.num_parameters)
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(
            f"INSERT INTO price_book (base_model, effective_from, prefill_micro_usd_per_mtok, "
            f"sample_micro_usd_per_mtok, train_micro_usd_per_mtok, note) VALUES (%s, now(), %s, %s, %s, %s) "
            f"ON CONFLICT (base_model, effective_from) DO NOTHING RETURNING {_COLUMNS}",
            (base.name, rates["prefill"], rates["sample"], rates["train"],
             f"from size: {base.num_parameters:,} parameters, {base.active_parameters:,} active"),
        ).fetchone()
    return _price(row) if row else db.one(current_price_sync(conn, base.name))  # (a concurrent add won)
