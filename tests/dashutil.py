"""Helpers for dashboard tests: logged-in HTTP clients, CSRF tokens from pages, operator tenants."""

from __future__ import annotations

import re
import uuid
from urllib.parse import quote

import httpx

CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


def csrf_of(html: str) -> str:
    """The CSRF token a page's forms carry."""
    return CSRF.search(html).group(1)


def login(stack, key: str, **client_args) -> httpx.Client:
    """An httpx client holding a dashboard session for `key` (cookies kept by the client)."""
    client = httpx.Client(base_url=stack.base_url, timeout=60, **client_args)
    form = client.get("/dashboard/login")
    r = client.post("/dashboard/login", data={"api_key": key, "csrf_token": csrf_of(form.text)})
    assert r.status_code == 303 and "quilt_session" in client.cookies, r.text[:500]
    return client


def run_url(model_id: str) -> str:
    return f"/dashboard/runs/{quote(model_id, safe='')}"


def operator_key(stack) -> str:
    """The API key of a new tenant with the operator role."""
    from core import db
    from tenancy.keys import create_key
    from tenancy.tenants import create_tenant

    name = f"op-{uuid.uuid4().hex[:8]}"
    with db.connect(stack.database_url) as conn:
        tenant = create_tenant(conn, name, role="operator")
        secret, _ = create_key(conn, tenant.id)
    return secret
