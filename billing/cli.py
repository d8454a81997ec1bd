"""Billing commands of the `quilt` CLI: usage, budgets, prices, Stripe sync and reconciliation.

`stack.cli` calls `add_commands` with its parser and its two helpers (the `--data-dir` option and the
"prepare the stack, return the database URL" function), so these commands behave like the others.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta

from core.errors import InvalidInput, NotFound


def _tenant(conn, name: str):
    from tenancy.tenants import get_tenant_by_name

    return get_tenant_by_name(conn, name)


def _key_id(conn, tenant_id: str, prefix: str) -> str:
    prefix = prefix.removesuffix("...")
    row = conn.execute("SELECT id FROM api_keys WHERE tenant_id = %s AND prefix = %s", (tenant_id, prefix)).fetchone()
    if row is None:
        raise NotFound(f"no API key with prefix {prefix!r} for this tenant (see `quilt keys list`)", field="key")
    return row["id"]


def _day(text: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a date YYYY-MM-DD, got {text!r}") from None


def _when(text: str) -> datetime:
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an ISO 8601 time, got {text!r}") from None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


# ------------------------------------------------------------------------------------------ usage


def cmd_usage(args, prepared: Callable) -> int:
    from billing import budgets, usage
    from billing.pricing import UNITS, usd_short
    from core import db

    today = datetime.now(UTC).date()
    since = args.since or today.replace(day=1)
    until = args.until or today + timedelta(days=1)
    with db.connect(prepared(args)) as conn:
        tenant = _tenant(conn, args.tenant)
        summary = usage.report_sync(conn, tenant.id, since, until)
        limits = budgets.list_budgets_sync(conn, tenant.id)
    if args.json:
        print(json.dumps({"tenant": tenant.name, "tenant_id": tenant.id, **summary.to_json()}, indent=2))
        return 0
    total = summary.total
    print(f"Spend of {tenant.name} ({tenant.id}) from {since} to {until - timedelta(days=1)} (UTC): "
          f"{usd_short(total['cost_micro_usd'])} over {total['requests']} requests")
    if not summary.rows:
        print("no usage in this period")
    else:
        print("\nBy day:")
        for day, v in summary.by_day.items():
            print(f"  {day}  {usd_short(v['cost_micro_usd']):>12}  {v['requests']:>7} requests")
        print("\nBy model:")
        width = max(len(m) for m in summary.by_model)
        for model, v in summary.by_model.items():
            tokens = "  ".join(f"{u} {v[f'{u}_tokens']:,}" for u in UNITS)
            print(f"  {model:<{width}}  {usd_short(v['cost_micro_usd']):>12}  tokens: {tokens}")
        print("\nBy unit:")
        for line in summary.by_unit():
            amount = (f"{line['gigabyte_hours']:,.3f} GB-hours" if line["unit"] == "storage"
                      else f"{line['tokens']:,} tokens")
            print(f"  {line['unit']:<8} {usd_short(line['cost_micro_usd']):>12}  {amount}")
    for b in limits:
        who = "tenant" if b["api_key_id"] is None else f"key {b['prefix']}..."
        print(f"\nBudget ({who}): {usd_short(b['spent_micro_usd'])} spent of "
              f"{usd_short(b['monthly_limit_micro_usd'])} this month")
    return 0


# ---------------------------------------------------------------------------------------- budgets


def cmd_budgets_set(args, prepared: Callable) -> int:
    from billing import budgets
    from billing.pricing import parse_usd, usd_short
    from core import db
    from tenancy import accounts

    try:
        limit = parse_usd(args.usd)
    except ValueError as exc:
        raise InvalidInput(str(exc), field="usd") from None
    with db.connect(prepared(args)) as conn:
        tenant = _tenant(conn, args.tenant)
        key_id = _key_id(conn, tenant.id, args.key) if args.key else None
        budgets.set_budget(conn, tenant.id, limit, key_id)
        accounts.record(conn, tenant.id, "cli", "budget.set", monthly_micro_usd=limit,
                        **({"api_key_prefix": args.key} if args.key else {}))
    print(f"monthly budget of {tenant.name}{' key ' + args.key if args.key else ''}: {usd_short(limit)}")
    return 0


def cmd_budgets_clear(args, prepared: Callable) -> int:
    from billing import budgets
    from core import db
    from tenancy import accounts

    with db.connect(prepared(args)) as conn:
        tenant = _tenant(conn, args.tenant)
        key_id = _key_id(conn, tenant.id, args.key) if args.key else None
        removed = budgets.clear_budget(conn, tenant.id, key_id)
        if removed:
            accounts.record(conn, tenant.id, "cli", "budget.cleared", **({"api_key_prefix": args.key} if args.key else {}))
    print("budget removed" if removed else "there was no such budget")
    return 0


def cmd_credits_grant(args, prepared: Callable) -> int:
    from billing import credits
    from billing.pricing import parse_usd, usd_short
    from core import db

    try:
        amount = parse_usd(args.usd)
        category = "paid" if args.paid else "promotional"
        credits.check_grant(amount, category, args.reason)
    except ValueError as exc:
        raise InvalidInput(str(exc), field="usd") from None
    with db.connect(prepared(args)) as conn, conn.transaction():
        tenant = _tenant(conn, args.tenant)
        grant_id = credits.grant(conn, tenant.id, amount, category, args.reason, "cli")
    print(f"granted {usd_short(amount)} of {category} credit to {tenant.name} (grant {grant_id})")
    return 0


def cmd_budgets_show(args, prepared: Callable) -> int:
    from billing import budgets
    from billing.pricing import usd_short
    from core import db

    with db.connect(prepared(args)) as conn:
        tenant = _tenant(conn, args.tenant)
        rows = budgets.list_budgets_sync(conn, tenant.id)
    if not rows:
        print(f"{tenant.name} has no budget")
    for b in rows:
        who = "tenant" if b["api_key_id"] is None else f"key {b['prefix']}..."
        print(f"{who}\t{usd_short(b['monthly_limit_micro_usd'])}/month\tspent {usd_short(b['spent_micro_usd'])}")
    return 0


# ----------------------------------------------------------------------------------------- prices


def cmd_prices_list(args, prepared: Callable) -> int:
    from billing import price_book
    from billing.pricing import usd
    from core import db

    with db.connect(prepared(args)) as conn:
        prices = price_book.list_prices_sync(conn)
    print("base model\teffective from\tprefill\tcached\tsample\ttrain   (USD per million tokens)\tstorage (USD per GB-month)")
    for p in prices:
        print(f"{p.base_model}\t{p.effective_from:%Y-%m-%d %H:%M}\t{usd(p.prefill_micro_usd_per_mtok)}\t"
              f"{usd(p.rate('cached'))}\t{usd(p.sample_micro_usd_per_mtok)}\t{usd(p.train_micro_usd_per_mtok)}\t"
              f"{usd(p.storage_micro_usd_per_gb_month)}\t{p.note}"
              + "".join(f"\tcontext > {above:,}: {percent}%" for above, percent in p.context_tiers))
    return 0


def cmd_prices_set(args, prepared: Callable) -> int:
    from billing import price_book
    from billing.pricing import check_context_tiers, parse_usd
    from core import db

    rates = {}
    for unit in ("prefill", "sample", "train", "cached", "storage"):
        if getattr(args, unit, None) is None:  # cached: 20% of prefill; storage: the table's default
            continue
        try:
            rates[unit] = parse_usd(getattr(args, unit))
        except ValueError as exc:
            raise InvalidInput(str(exc), field=unit) from None
    tiers = []
    for text in getattr(args, "context_tier", None) or ():
        above, _, percent = text.partition(":")
        if not (above.strip().isdigit() and percent.strip().isdigit()):
            raise InvalidInput(f"--context-tier {text!r} is not ABOVE_TOKENS:PERCENT (e.g. 32768:150)", field="context_tier")
        tiers.append([int(above), int(percent)])
    try:
        tiers = [list(t) for t in check_context_tiers(tiers)]
    except ValueError as exc:
        raise InvalidInput(str(exc), field="context_tier") from None
    start = args.effective_from or datetime.now(UTC)
    with db.connect(prepared(args)) as conn:
        p = price_book.add_price(conn, base_model=args.base_model, effective_from=start, note=args.note,
                                 context_tiers=tiers, **rates)
    print(f"price of {p.base_model} from {p.effective_from:%Y-%m-%d %H:%M %Z}: prefill {args.prefill}, "
          f"sample {args.sample}, train {args.train} USD per million tokens")
    return 0


# ------------------------------------------------------------------------------------------ stripe


def cmd_billing_sync(args, prepared: Callable) -> int:
    from billing import stripe_sync
    from core.settings import get_billing_settings

    report = stripe_sync.sync(prepared(args), get_billing_settings(), as_of=args.as_of)
    print(report.summary())
    for line in report.errors + report.anomalies:
        print("  " + line)
    return 0 if not (report.failed or report.anomalies) else 1


def cmd_billing_reconcile(args, prepared: Callable) -> int:
    from billing import stripe_sync
    from billing.stripe_api import StripeGateway
    from core.settings import get_billing_settings

    settings = get_billing_settings()
    gateway = StripeGateway(settings) if args.stripe and settings.stripe_enabled else None
    report = stripe_sync.reconcile(prepared(args), settings, gateway=gateway, as_of=args.as_of)
    print(report.text())
    return 0 if report.ok else 1


def cmd_billing_events(args, prepared: Callable) -> int:
    from core import db

    with db.connect(prepared(args)) as conn:
        rows = conn.execute(
            "SELECT identifier, status, value, attempts, last_error FROM stripe_meter_events "
            "WHERE %s::text IS NULL OR status = %s ORDER BY window_start DESC, identifier LIMIT %s",
            (args.status, args.status, args.limit),
        ).fetchall()
    for r in rows:
        print(f"{r['identifier']}\t{r['status']}\t{r['value']}\tattempts={r['attempts']}\t{r['last_error'] or ''}")
    return 0


def _set_status(args, prepared: Callable, status: str, allowed: tuple[str, ...]) -> int:
    from core import db

    with db.connect(prepared(args)) as conn:
        cur = conn.execute(
            "UPDATE stripe_meter_events SET status = %s, last_error = %s, "
            "first_attempt_at = CASE WHEN %s = 'pending' THEN NULL ELSE first_attempt_at END, "
            "sent_at = CASE WHEN %s = 'sent' THEN now() ELSE sent_at END "
            "WHERE identifier = %s AND status = ANY(%s)",
            (status, f"set to {status} by an operator", status, status, args.identifier, list(allowed)),
        )
    if cur.rowcount == 0:
        print(f"no meter event {args.identifier!r} in status {' or '.join(allowed)}")
        return 1
    print(f"{args.identifier}: {status}")
    return 0


# -------------------------------------------------------------------------------------- the parser


def add_commands(sub, data_dir_option: Callable, prepared: Callable) -> None:
    """Add `usage`, `budgets`, `credits`, `prices` and `billing` to the `quilt` parser."""

    def command(parser, func):
        data_dir_option(parser)
        parser.set_defaults(func=lambda args: func(args, prepared))

    p = sub.add_parser("usage", help="a tenant's spend by day and by model")
    p.add_argument("tenant")
    p.add_argument("--since", type=_day, help="first day, YYYY-MM-DD (default: the 1st of this month, UTC)")
    p.add_argument("--until", type=_day, help="day after the last one (default: tomorrow)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    command(p, cmd_usage)

    budgets = sub.add_parser("budgets", help="monthly spend limits").add_subparsers(dest="action", required=True)
    p = budgets.add_parser("set", help="set a tenant's (or one key's) monthly limit in USD")
    p.add_argument("tenant")
    p.add_argument("--usd", required=True, help="the limit, e.g. 25 or 0.50")
    p.add_argument("--key", help="API key prefix (tml-xxxxxxxx); default: the whole tenant")
    command(p, cmd_budgets_set)
    p = budgets.add_parser("clear", help="remove a limit")
    p.add_argument("tenant")
    p.add_argument("--key", help="API key prefix; default: the tenant's own limit")
    command(p, cmd_budgets_clear)
    p = budgets.add_parser("show", help="limits and this month's spend")
    p.add_argument("tenant")
    command(p, cmd_budgets_show)

    credit = sub.add_parser("credits", help="credit grants").add_subparsers(dest="action", required=True)
    p = credit.add_parser("grant", help="grant a tenant credit, used by its usage from today on")
    p.add_argument("tenant")
    p.add_argument("--usd", required=True, help="the amount, e.g. 100 or 25.50")
    p.add_argument("--reason", required=True)
    p.add_argument("--paid", action="store_true", help="prepaid credit (default: promotional)")
    command(p, cmd_credits_grant)

    prices = sub.add_parser("prices", help="the price book").add_subparsers(dest="action", required=True)
    p = prices.add_parser("list", help="every price entry")
    command(p, cmd_prices_list)
    p = prices.add_parser("set", help="add a price entry (USD per million tokens) from a date on")
    p.add_argument("base_model")
    p.add_argument("--prefill", required=True)
    p.add_argument("--sample", required=True)
    p.add_argument("--train", required=True)
    p.add_argument("--cached", help="USD per million prefix-cache hits (default: 20%% of --prefill)")
    p.add_argument("--storage", help="USD per GB-month of checkpoints (default: the price book's default)")
    p.add_argument("--context-tier", action="append", metavar="ABOVE_TOKENS:PERCENT",
                   help="models with a context above ABOVE_TOKENS pay PERCENT of every token rate (repeat for more "
                        "tiers, e.g. 32768:150 131072:200; default: 100 at any context)")
    p.add_argument("--from", dest="effective_from", type=_when, help="ISO time (default: now)")
    p.add_argument("--note", default="")
    command(p, cmd_prices_set)

    billing = sub.add_parser("billing", help="Stripe sync").add_subparsers(dest="action", required=True)
    p = billing.add_parser("sync", help="send sealed hour windows to Stripe now (Celery beat does it hourly)")
    p.add_argument("--as-of", type=_when, help="treat windows as sealed as of this time")
    command(p, cmd_billing_sync)
    p = billing.add_parser("reconcile", help="compare the ledger with what Stripe acknowledged")
    p.add_argument("--as-of", type=_when)
    p.add_argument("--stripe", action="store_true", help="also ask Stripe for its meter summaries")
    command(p, cmd_billing_reconcile)
    p = billing.add_parser("events", help="the meter-event outbox")
    p.add_argument("--status", choices=("pending", "sent", "failed", "review"))
    p.add_argument("--limit", type=int, default=50)
    command(p, cmd_billing_events)
    p = billing.add_parser("requeue", help="send a failed or in-review meter event again")
    p.add_argument("identifier")
    command(p, lambda args, prep: _set_status(args, prep, "pending", ("failed", "review")))
    p = billing.add_parser("mark-sent", help="record that Stripe has a meter event (checked by hand)")
    p.add_argument("identifier")
    command(p, lambda args, prep: _set_status(args, prep, "sent", ("pending", "failed", "review")))
