"""The usage ledger: one append-only row per completed request, priced when it is written.

Workers call `record_usage` inside the transaction that marks the request done, so a request is
done and billed together or neither; the ledger's unique `request_id` makes a second call for the
same request a no-op, so a request is billed at most once. A failed request is never recorded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime

import psycopg
from psycopg.rows import DictRow, dict_row

from billing.price_book import current_price_sync
from billing.pricing import Cost, Units, context_percent, cost_of
from core import records, run_metrics

log = logging.getLogger("quilt.billing")


@dataclass(frozen=True)
class LedgerEntry:
    id: int
    request_id: str
    tenant_id: str
    base_model: str
    units: Units
    price_id: int | None
    cost: Cost
    created_at: datetime


_INSERT = """
INSERT INTO usage_ledger (request_id, tenant_id, api_key_id, model_id, base_model,
                          prefill_tokens, sample_tokens, train_tokens, cached_tokens, storage_byte_hours, price_id,
                          prefill_micro_usd, sample_micro_usd, train_micro_usd, cached_micro_usd, storage_micro_usd,
                          cost_micro_usd, context_percent, created_at)
VALUES (%(request_id)s, %(tenant_id)s,
        COALESCE(%(api_key_id)s, (SELECT api_key_id FROM requests WHERE id = %(request_id)s)),
        %(model_id)s, %(base_model)s, %(prefill)s, %(sample)s, %(train)s, %(cached)s, %(storage)s, %(price_id)s,
        %(prefill_cost)s, %(sample_cost)s, %(train_cost)s, %(cached_cost)s, %(storage_cost)s, %(cost)s,
        %(context_percent)s, COALESCE(%(billed_at)s, now()))
ON CONFLICT (request_id) DO NOTHING
RETURNING id, api_key_id, created_at
"""

def _adding(alias: str, columns: str) -> str:
    """An upsert's SET list that adds the new row's `columns` to the existing row (`alias`)."""
    return ",\n    ".join(f"{c} = {alias}.{c} + EXCLUDED.{c}" for c in columns.split())


_UNIT_SUMS = ("prefill_tokens sample_tokens train_tokens cached_tokens storage_byte_hours prefill_micro_usd "
              "sample_micro_usd train_micro_usd cached_micro_usd storage_micro_usd")
_UNIT_VALUES = ("%(prefill)s, %(sample)s, %(train)s, %(cached)s, %(storage)s, %(prefill_cost)s, %(sample_cost)s, "
                "%(train_cost)s, %(cached_cost)s, %(storage_cost)s")

_DAILY = f"""
INSERT INTO usage_daily AS d (tenant_id, api_key_id, day, base_model, requests, {", ".join(_UNIT_SUMS.split())},
                              cost_micro_usd)
VALUES (%(tenant_id)s, %(key)s, (%(at)s::timestamptz AT TIME ZONE 'UTC')::date, %(base_model)s, %(requests)s,
        {_UNIT_VALUES}, %(cost)s)
ON CONFLICT (tenant_id, day, base_model, api_key_id) DO UPDATE SET
    requests = d.requests + EXCLUDED.requests,
    {_adding("d", _UNIT_SUMS + " cost_micro_usd")}
"""

_HOURLY = f"""
INSERT INTO usage_hourly AS h (tenant_id, hour, requests, prefill_tokens, sample_tokens, train_tokens, cached_tokens,
                               storage_byte_hours, cost_micro_usd)
VALUES (%(tenant_id)s, date_trunc('hour', %(at)s::timestamptz, 'UTC'), %(requests)s, %(prefill)s, %(sample)s,
        %(train)s, %(cached)s, %(storage)s, %(cost)s)
ON CONFLICT (tenant_id, hour) DO UPDATE SET
    requests = h.requests + EXCLUDED.requests,
    {_adding("h", "prefill_tokens sample_tokens train_tokens cached_tokens storage_byte_hours cost_micro_usd")}
"""

# model_id is a training model or a sampler (or neither); either belongs to one client session.
_HOURLY_SESSIONS = f"""
INSERT INTO usage_hourly_sessions AS u (tenant_id, hour, base_model, session_id, api_key_id,
                                        {", ".join(_UNIT_SUMS.split())})
VALUES (%(tenant_id)s, date_trunc('hour', %(at)s::timestamptz, 'UTC'), %(base_model)s,
        COALESCE((SELECT session_id FROM training_models WHERE id = %(model_id)s),
                 (SELECT session_id FROM sampling_sessions WHERE id = %(model_id)s), ''),
        %(key)s, {_UNIT_VALUES})
ON CONFLICT (tenant_id, hour, base_model, session_id, api_key_id) DO UPDATE SET
    {_adding("u", _UNIT_SUMS)}
"""


def record_usage(conn: psycopg.Connection[DictRow], *, request_id: str, tenant_id: str, api_key_id: str | None,
                 model_id: str | None, base_model: str, units: Units,
                 billed_at: datetime | None = None) -> LedgerEntry | None:
    """Price and record one successfully completed request; returns its entry, or None if this
    request was already recorded (a redelivery): it is never billed twice.

    Call it on the SAME connection and inside the SAME transaction that marks the request done, and
    only for requests that succeeded (a failed request is not billed)::

        with conn.transaction():
            records.mark_finished(conn, request_id, None)
            record_usage(conn, request_id=request_id, tenant_id=tenant_id, api_key_id=None,
                         model_id=model_id, base_model=base_model,
                         units=Units(prefill_tokens=prompt_tokens, sample_tokens=sampled_tokens))

    Args:
        request_id: the request's id (the ledger is unique on it).
        tenant_id: who pays.
        api_key_id: the key that submitted the request; None = read it from the `requests` row with
            this id (NULL if there is none).
        model_id: the training model or sampler the request ran on (informational).
        base_model: catalogue name of the base model; selects the price.
        units: metered tokens. Trainer: `forward_backward` -> train_tokens = model-input tokens;
            `forward` -> prefill_tokens. Sampler (`billing.pricing.sampling_units`): each sequence's
            prompt tokens, the engine's prefix-cache hits as cached_tokens and the rest as
            prefill_tokens; sample_tokens = tokens generated across all sequences. Storage
            (`billing.storage`): storage_byte_hours, under a `storage:` id per tenant, base and hour.
        billed_at: when the usage happened, if not now: a storage row is dated at the start of the
            hour it bills (it is written after that hour ends), so every rollup (usage_daily and
            usage_hourly, the Stripe window, the month) puts Dec 31 23:00 in December.
            Requests with no tokens (optim_step, save, ...) are recorded at zero cost so every
            completed request has a row.

    The price is the price-book entry for `base_model` in force at the transaction's `now()`; a base
    model without any price is recorded at zero cost with `price_id` NULL (and logged), so usage is
    never lost for want of a price.
    """
    price = current_price_sync(conn, base_model)
    if price is None and not units.empty:
        log.warning("no price for base model %r: request %s recorded at zero cost", base_model, request_id)
    percent = 100
    if price is not None and price.context_tiers and model_id is not None and not units.empty:
        # a training model's context tier (a sampler's or storage's model_id names no training model)
        with conn.cursor(row_factory=dict_row) as cur:
            row = cur.execute("SELECT context_length FROM training_models WHERE id = %s", (model_id,)).fetchone()
        percent = context_percent(row["context_length"] if row else None, price.context_tiers)
    cost = cost_of(units, price, percent)
    params = {
        "request_id": request_id, "tenant_id": tenant_id, "api_key_id": api_key_id, "model_id": model_id,
        "base_model": base_model, "prefill": units.prefill_tokens, "sample": units.sample_tokens,
        "train": units.train_tokens, "cached": units.cached_tokens, "storage": units.storage_byte_hours,
        "price_id": price.id if price else None,
        "prefill_cost": cost.prefill_micro_usd, "sample_cost": cost.sample_micro_usd,
        "train_cost": cost.train_micro_usd, "cached_cost": cost.cached_micro_usd,
        "storage_cost": cost.storage_micro_usd, "cost": cost.total_micro_usd, "context_percent": percent,
        # A storage row (billing.storage) is a period's charge, not a request.
        "requests": 0 if units.storage_byte_hours else 1,
        "billed_at": billed_at,
    }
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(_INSERT, params).fetchone()
        if row is None:
            return None
        params.update(at=row["created_at"], key=row["api_key_id"] or "")
        cur.execute(_DAILY, params)
        cur.execute(_HOURLY, params)
        if not units.empty:
            cur.execute(_HOURLY_SESSIONS, params)
    return LedgerEntry(id=row["id"], request_id=request_id, tenant_id=tenant_id, base_model=base_model,
                       units=units, price_id=price.id if price else None, cost=cost, created_at=row["created_at"])


def settle(conn: psycopg.Connection[DictRow], *, request_id: str, tenant_id: str, model_id: str | None, base_model: str,
           error: dict | None, units: Units | None,
           metrics: run_metrics.StepMetrics | None = None) -> records.Settled | None:
    """Finish a request the way every worker must: mark it done or failed and, if it succeeded and
    only the first time, record its usage, all in one transaction. A redelivery after a crash
    changes nothing; a failed request (or one with `units` None) is not billed. Returns how the row
    stands (`core.records.Settled`: the first outcome wins), None when there is no such row; its
    future is published only after this returns (core.consumer), so no client reads an answer while
    the request still counts against its quota.

    `metrics` (the trainer, for a forward_backward): the request's row of its run's per-step
    metrics, written in the same transaction and under the same first-time-and-succeeded rule, so
    a run's curve has exactly one point per completed request."""
    with conn.transaction():
        if not records.mark_finished(conn, request_id, error):
            return records.settled_before(conn, request_id)
        if error is None and units is not None:
            record_usage(conn, request_id=request_id, tenant_id=tenant_id, api_key_id=None, model_id=model_id,
                         base_model=base_model, units=units)
        if error is None and metrics is not None and model_id is not None:
            run_metrics.insert_trainer_row(conn, tenant_id=tenant_id, model_id=model_id, request_id=request_id,
                                           row=metrics)
    return records.Settled(first=True, error=error)
