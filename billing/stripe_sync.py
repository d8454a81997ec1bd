"""Hourly roll-up of the ledger into Stripe Billing Meter events, and reconciliation.

How a window reaches Stripe exactly once:

1. Plan (one transaction, under an advisory lock so only one sync runs): for every billed tenant,
   meter and *sealed* hour window (it ended at least `billing_settle_s` ago), compare the window's
   ledger total (`usage_hourly`, written with the ledger) with what the outbox
   (`stripe_meter_events`) already holds for it. A difference becomes a new outbox row: revision 1
   carries the window's total, a later revision the usage that committed after the window was
   planned. The row's `identifier` is derived from (customer, meter, window[, revision]) and its
   value is fixed before anything is sent.
2. Send: each pending row is marked attempted (committed), then POSTed with its identifier (and
   the same string as idempotency key), then marked sent. A crash anywhere leaves the row pending
   with the same identifier and value, so the next run resends it and Stripe recognises it; an
   answer "already have it" counts as acknowledged. A row first tried longer ago than Stripe's
   de-duplication horizon is never resent blindly: it goes to `review`.
3. Reconcile: ledger totals (recomputed from `usage_ledger` itself) against what Stripe
   acknowledged (rows `sent`), optionally against Stripe's own meter summaries; every difference
   is reported with its cause (pending, failed, review, not yet planned).

`plan_events` is pure; `sync` and `reconcile` do the I/O.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import psycopg
from psycopg.rows import DictRow, dict_row

from billing import credits
from billing.customers import ensure_all_customers
from billing.stripe_api import StripeGateway
from core import db
from core.settings import BillingSettings

log = logging.getLogger("quilt.billing.sync")

SYNC_LOCK_ID = 0x5175696C7442  # "QuiltB"
MAX_IDENTIFIER = 100  # Stripe's limit
LOOKBACK = timedelta(days=35)  # Stripe refuses meter events older than this
WINDOW = timedelta(hours=1)
MAX_CONSECUTIVE_RETRIES = 3


@dataclass(frozen=True)
class Meter:
    """One Stripe meter fed from one column of the hourly rollup."""

    key: str
    display_name: str

    def event_name(self, prefix: str) -> str:
        return f"{prefix}_{self.key}"


# The cost meter is the one to attach a price to (1 unit = 1 micro-USD, i.e. a unit amount of
# 0.0001 cents); the token meters make usage visible in Stripe.
METERS = (
    Meter("cost_micro_usd", "Quilt spend (micro-USD)"),
    Meter("prefill_tokens", "Quilt prefill tokens"),
    Meter("sample_tokens", "Quilt sampled tokens"),
    Meter("train_tokens", "Quilt trained tokens"),
)


def identifier(customer_id: str, event_name: str, window_start: datetime, revision: int) -> str:
    """Deterministic meter-event identifier for (customer, meter, window[, revision])."""
    text = f"{customer_id}:{event_name}:{window_start.astimezone(UTC):%Y%m%dT%H}Z"
    if revision > 1:
        text += f":r{revision}"
    if len(text) > MAX_IDENTIFIER:
        text = "quilt-" + hashlib.sha256(text.encode()).hexdigest()[:64]
    return text


# ----------------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class WindowTotal:
    """A sealed hour of one tenant's ledger: meter key -> total."""

    tenant_id: str
    customer_id: str
    window_start: datetime
    values: dict[str, int]


@dataclass(frozen=True)
class PlannedSoFar:
    value: int
    revision: int


@dataclass(frozen=True)
class PlannedEvent:
    identifier: str
    tenant_id: str
    customer_id: str
    event_name: str
    window_start: datetime
    revision: int
    value: int


def plan_events(totals: list[WindowTotal], planned: dict[tuple[str, str, datetime], PlannedSoFar],
                prefix: str) -> tuple[list[PlannedEvent], list[str]]:
    """New outbox rows that bring every (tenant, meter, window) up to its ledger total.

    Returns (events, anomalies). The ledger is append-only, so a window's total never shrinks; if
    the outbox already holds more than the ledger, that is reported, never "corrected" by sending a
    negative value.
    """
    events, anomalies = [], []
    for w in totals:
        for meter in METERS:
            name = meter.event_name(prefix)
            total = w.values.get(meter.key, 0)
            so_far = planned.get((w.tenant_id, name, w.window_start), PlannedSoFar(0, 0))
            delta = total - so_far.value
            if delta > 0:
                rev = so_far.revision + 1
                events.append(PlannedEvent(identifier(w.customer_id, name, w.window_start, rev), w.tenant_id,
                                           w.customer_id, name, w.window_start, rev, delta))
            elif delta < 0:
                anomalies.append(f"{w.tenant_id} {name} {w.window_start.astimezone(UTC):%Y-%m-%dT%H}Z: "
                                 f"outbox holds {so_far.value}, ledger {total}")
    return events, anomalies


# ------------------------------------------------------------------------------------------ I/O

_SEALED = "w.hour + interval '1 hour' + make_interval(secs => %(settle)s) <= %(as_of)s"

_TOTALS = f"""
SELECT w.tenant_id, b.stripe_customer_id, w.hour, w.prefill_tokens, w.sample_tokens, w.train_tokens,
       w.cost_micro_usd
FROM usage_hourly w JOIN billing_accounts b ON b.tenant_id = w.tenant_id
WHERE w.hour >= b.sync_from AND w.hour > %(as_of)s - interval '35 days' AND {_SEALED}
"""

_PLANNED = """
SELECT tenant_id, event_name, window_start, sum(value)::bigint AS value, max(revision) AS revision
FROM stripe_meter_events WHERE window_start > %(as_of)s - interval '36 days'
GROUP BY tenant_id, event_name, window_start
"""

_REVIEW_NOTE = ("first sent at {first:%Y-%m-%d %H:%M %Z} and never acknowledged; Stripe may no longer "
                "recognise a resend. Check Stripe, then `quilt billing mark-sent` or `quilt billing requeue`")

_INSERT_EVENT = """
INSERT INTO stripe_meter_events (identifier, tenant_id, stripe_customer_id, event_name, window_start, revision, value)
VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING
"""


@dataclass
class SyncReport:
    disabled: bool = False
    busy: bool = False
    customers_created: int = 0
    meters_created: int = 0
    credit_grants_sent: int = 0
    planned: int = 0
    accepted: int = 0
    duplicates: int = 0
    failed: int = 0
    to_review: int = 0
    left_pending: int = 0
    anomalies: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def summary(self) -> str:
        if self.disabled:
            return "Stripe sync disabled (set QUILT_STRIPE_API_KEY)"
        if self.busy:
            return "another Stripe sync is running"
        return (f"customers +{self.customers_created}, meters +{self.meters_created}, planned {self.planned}, "
                f"accepted {self.accepted}, already there {self.duplicates}, failed {self.failed}, "
                f"to review {self.to_review}, still pending {self.left_pending}")


def _connect(db_url: str) -> psycopg.Connection[DictRow]:
    return psycopg.connect(db_url, autocommit=True, row_factory=dict_row)


def ensure_meters(conn: psycopg.Connection[DictRow], gateway: StripeGateway, settings: BillingSettings) -> int:
    """Look our meters up in Stripe (one list call), create missing ones if allowed, and record
    their ids (reconciliation asks Stripe for summaries by meter id). Returns how many were created."""
    found = gateway.find_meters()
    created = 0
    for meter in METERS:
        name = meter.event_name(settings.stripe_meter_prefix)
        meter_id = found.get(name)
        if meter_id is None:
            if not settings.stripe_create_meters:
                raise RuntimeError(f"Stripe has no active meter for event {name!r}; create it or set "
                                   "QUILT_STRIPE_CREATE_METERS=true")
            meter_id = gateway.create_meter(name, meter.display_name)
            created += 1
        conn.execute("INSERT INTO stripe_meters (event_name, stripe_meter_id) VALUES (%s, %s) "
                     "ON CONFLICT (event_name) DO UPDATE SET stripe_meter_id = EXCLUDED.stripe_meter_id",
                     (name, meter_id))
    return created


def plan(conn: psycopg.Connection[DictRow], settings: BillingSettings, as_of: datetime | None) -> tuple[int, list[str]]:
    """Write new outbox rows for every sealed window whose ledger total moved; one transaction."""
    params = {"as_of": as_of or _db_now(conn), "settle": settings.billing_settle_s}
    with conn.transaction():
        totals = [WindowTotal(r["tenant_id"], r["stripe_customer_id"], r["hour"],
                              {m.key: int(r[m.key]) for m in METERS})
                  for r in conn.execute(_TOTALS, params)]
        planned = {(r["tenant_id"], r["event_name"], r["window_start"]): PlannedSoFar(int(r["value"]), r["revision"])
                   for r in conn.execute(_PLANNED, params)}
        events, anomalies = plan_events(totals, planned, settings.stripe_meter_prefix)
        with conn.cursor() as cur:
            cur.executemany(_INSERT_EVENT, [(e.identifier, e.tenant_id, e.customer_id, e.event_name, e.window_start,
                                             e.revision, e.value) for e in events])
    return len(events), anomalies


def _db_now(conn: psycopg.Connection[DictRow]) -> datetime:
    return db.one(conn.execute("SELECT now() AS now").fetchone())["now"]


def send_pending(conn: psycopg.Connection[DictRow], gateway: StripeGateway, settings: BillingSettings,
                 report: SyncReport) -> None:
    """Send every pending outbox row, oldest window first (see the module docstring)."""
    rows = conn.execute(
        "SELECT identifier, stripe_customer_id, event_name, window_start, value, first_attempt_at, "
        "first_attempt_at < now() - make_interval(secs => %s) AS too_old "
        "FROM stripe_meter_events WHERE status = 'pending' ORDER BY window_start, identifier",
        (settings.billing_resend_limit_s,),
    ).fetchall()
    retries_in_a_row = 0
    for row in rows:
        ident = row["identifier"]
        if row["too_old"]:
            conn.execute(
                "UPDATE stripe_meter_events SET status = 'review', last_error = %s WHERE identifier = %s",
                (_REVIEW_NOTE.format(first=row["first_attempt_at"]), ident))
            report.to_review += 1
            continue
        # Committed before the call: from here on this identifier may exist at Stripe.
        conn.execute("UPDATE stripe_meter_events SET attempts = attempts + 1, "
                     "first_attempt_at = COALESCE(first_attempt_at, now()) WHERE identifier = %s", (ident,))
        result = gateway.send_meter_event(identifier=ident, event_name=row["event_name"],
                                          customer_id=row["stripe_customer_id"], value=int(row["value"]),
                                          timestamp=row["window_start"])
        if result.acknowledged:
            conn.execute("UPDATE stripe_meter_events SET status = 'sent', sent_at = now(), last_error = %s "
                         "WHERE identifier = %s", (result.message or None, ident))
            report.accepted += result.outcome == "accepted"
            report.duplicates += result.outcome == "duplicate"
            retries_in_a_row = 0
            continue
        if result.outcome == "failed":
            conn.execute("UPDATE stripe_meter_events SET status = 'failed', last_error = %s WHERE identifier = %s",
                         (result.message, ident))
            report.failed += 1
            log.error("Stripe refused meter event %s: %s", ident, result.message)
            continue
        conn.execute("UPDATE stripe_meter_events SET last_error = %s WHERE identifier = %s", (result.message, ident))
        report.errors.append(f"{ident}: {result.message}")
        retries_in_a_row += 1
        if result.outcome == "abort" or retries_in_a_row >= MAX_CONSECUTIVE_RETRIES:
            log.warning("stopping this Stripe sync after: %s", result.message)
            break
    report.left_pending = db.one(conn.execute(
        "SELECT count(*) AS n FROM stripe_meter_events WHERE status = 'pending'").fetchone())["n"]


def sync(db_url: str, settings: BillingSettings, *, gateway: StripeGateway | None = None,
         as_of: datetime | None = None) -> SyncReport:
    """One full run: customers, meters, plan, send. `as_of` (default: the database's now) decides
    which windows are sealed; tests and back-fills may pass a later time."""
    report = SyncReport()
    if not settings.stripe_enabled:
        report.disabled = True
        return report
    gateway = gateway or StripeGateway(settings)
    with _connect(db_url) as conn:
        if not db.one(conn.execute("SELECT pg_try_advisory_lock(%s) AS ok", (SYNC_LOCK_ID,)).fetchone())["ok"]:
            report.busy = True
            return report
        try:
            report.customers_created = ensure_all_customers(conn, gateway)
            report.meters_created = ensure_meters(conn, gateway, settings)
            report.credit_grants_sent = credits.send_to_stripe(conn, gateway)
            report.planned, report.anomalies = plan(conn, settings, as_of)
            send_pending(conn, gateway, settings, report)
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (SYNC_LOCK_ID,))
    for anomaly in report.anomalies:
        log.error("billing anomaly: %s", anomaly)
    log.info("Stripe sync: %s", report.summary())
    return report


# ------------------------------------------------------------------------------------ reconcile


@dataclass
class ReconcileLine:
    """One tenant and meter over its sealed, billable windows."""

    tenant_id: str
    customer_id: str
    event_name: str
    ledger: int = 0
    acknowledged: int = 0
    pending: int = 0
    failed: int = 0
    review: int = 0
    stripe: int | None = None  # Stripe's own summary, when asked for

    @property
    def unplanned(self) -> int:
        return self.ledger - (self.acknowledged + self.pending + self.failed + self.review)

    @property
    def gap(self) -> int:
        return self.ledger - self.acknowledged

    @property
    def ok(self) -> bool:
        return self.gap == 0 and (self.stripe is None or self.stripe == self.acknowledged)

    def explain(self) -> str:
        causes = [f"{n} {what}" for n, what in ((self.pending, "pending"), (self.failed, "failed"),
                                                (self.review, "in review"), (self.unplanned, "not yet planned"))
                  if n]
        text = f"{self.tenant_id} ({self.customer_id}) {self.event_name}: ledger {self.ledger}, " \
               f"acknowledged {self.acknowledged}"
        if causes:
            text += " (" + ", ".join(causes) + ")"
        if self.stripe is not None and self.stripe != self.acknowledged:
            text += f"; Stripe reports {self.stripe}"
        return text


@dataclass
class ReconcileReport:
    as_of: datetime
    lines: list[ReconcileLine]
    rollup_drift: list[str] = field(default_factory=list)

    @property
    def gaps(self) -> list[ReconcileLine]:
        return [line for line in self.lines if not line.ok]

    @property
    def ok(self) -> bool:
        return not self.gaps and not self.rollup_drift

    def text(self) -> str:
        head = (f"reconciliation as of {self.as_of:%Y-%m-%d %H:%M}Z: {len(self.lines)} tenant-meter lines, "
                f"{len(self.gaps)} with a gap")
        out = [head]
        out += ["  gap: " + line.explain() for line in self.gaps]
        out += ["  rollup drift: " + d for d in self.rollup_drift]
        return "\n".join(out)


_LEDGER_WINDOWS = """
SELECT l.tenant_id, b.stripe_customer_id, b.sync_from, date_trunc('hour', l.created_at, 'UTC') AS hour,
       sum(l.prefill_tokens)::bigint AS prefill_tokens, sum(l.sample_tokens)::bigint AS sample_tokens,
       sum(l.train_tokens)::bigint AS train_tokens, sum(l.cost_micro_usd)::bigint AS cost_micro_usd
FROM usage_ledger l JOIN billing_accounts b ON b.tenant_id = l.tenant_id
WHERE l.created_at >= b.sync_from AND l.created_at > %(as_of)s - interval '35 days' - interval '1 hour'
  AND date_trunc('hour', l.created_at, 'UTC') > %(as_of)s - interval '35 days'
  AND date_trunc('hour', l.created_at, 'UTC') + interval '1 hour' + make_interval(secs => %(settle)s) <= %(as_of)s
GROUP BY 1, 2, 3, 4
"""

_HOURLY_WINDOWS = """
SELECT w.tenant_id, w.hour, w.prefill_tokens, w.sample_tokens, w.train_tokens, w.cost_micro_usd
FROM usage_hourly w JOIN billing_accounts b ON b.tenant_id = w.tenant_id
WHERE w.hour >= b.sync_from AND w.hour > %(as_of)s - interval '35 days'
  AND w.hour + interval '1 hour' + make_interval(secs => %(settle)s) <= %(as_of)s
"""

_OUTBOX = """
SELECT e.tenant_id, e.event_name, e.status, sum(e.value)::bigint AS value
FROM stripe_meter_events e
WHERE e.window_start > %(as_of)s - interval '35 days'
  AND e.window_start + interval '1 hour' + make_interval(secs => %(settle)s) <= %(as_of)s
GROUP BY 1, 2, 3
"""


def reconcile(db_url: str, settings: BillingSettings, *, gateway: StripeGateway | None = None,
              as_of: datetime | None = None) -> ReconcileReport:
    """Compare, per billed tenant and meter, the ledger with what Stripe acknowledged, over the
    sealed windows Stripe still accepts (the last 35 days).

    With a `gateway`, Stripe's own meter summaries are fetched too (they lag by minutes in live
    Stripe, so run this well after a sync)."""
    prefix = settings.stripe_meter_prefix
    with _connect(db_url) as conn:
        as_of = (as_of or _db_now(conn)).astimezone(UTC)
        params = {"as_of": as_of, "settle": settings.billing_settle_s}
        lines: dict[tuple[str, str], ReconcileLine] = {}
        ledger_hours: dict[tuple[str, datetime], dict] = {}
        for r in conn.execute(_LEDGER_WINDOWS, params):
            ledger_hours[(r["tenant_id"], r["hour"])] = r
            for m in METERS:
                line = lines.setdefault((r["tenant_id"], m.event_name(prefix)),
                                        ReconcileLine(r["tenant_id"], r["stripe_customer_id"], m.event_name(prefix)))
                line.ledger += int(r[m.key])
        drift = []
        hourly = {(r["tenant_id"], r["hour"]): r for r in conn.execute(_HOURLY_WINDOWS, params)}
        for key in sorted(set(hourly) | set(ledger_hours)):
            a, b = ledger_hours.get(key), hourly.get(key)
            if any(int((a or {}).get(m.key, 0)) != int((b or {}).get(m.key, 0)) for m in METERS):
                drift.append(f"{key[0]} {key[1].astimezone(UTC):%Y-%m-%dT%H}Z: usage_hourly disagrees with usage_ledger")
        customers = {r["tenant_id"]: r["stripe_customer_id"]
                     for r in conn.execute("SELECT tenant_id, stripe_customer_id FROM billing_accounts")}
        for r in conn.execute(_OUTBOX, params):
            line = lines.setdefault((r["tenant_id"], r["event_name"]),
                                    ReconcileLine(r["tenant_id"], customers.get(r["tenant_id"], "?"), r["event_name"]))
            status = "acknowledged" if r["status"] == "sent" else r["status"]
            setattr(line, status, getattr(line, status) + int(r["value"]))
        if gateway is not None:
            meter_ids = {r["event_name"]: r["stripe_meter_id"]
                         for r in conn.execute("SELECT event_name, stripe_meter_id FROM stripe_meters")}
            sync_from = {r["tenant_id"]: r["sync_from"]
                         for r in conn.execute("SELECT tenant_id, sync_from FROM billing_accounts")}
            end = _floor_hour(as_of - timedelta(seconds=settings.billing_settle_s))
            horizon = _floor_hour(as_of - LOOKBACK) + WINDOW  # the first window still inside Stripe's 35 days
            for line in lines.values():
                meter_id = meter_ids.get(line.event_name)
                start = max(sync_from.get(line.tenant_id, horizon), horizon)
                if meter_id and start < end:
                    line.stripe = gateway.meter_total(meter_id, line.customer_id, start, end)
    return ReconcileReport(as_of, sorted(lines.values(), key=lambda x: (x.tenant_id, x.event_name)), drift)


def _floor_hour(t: datetime) -> datetime:
    return t.replace(minute=0, second=0, microsecond=0)
