"""Helpers for dashboard tests: logged-in HTTP clients, CSRF tokens from pages, operator tenants."""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("QUILT_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SHOTS = Path(os.environ.get("QUILT_TEST_ARTIFACTS") or ROOT / "artifacts") / "screenshots"


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """Debian's Chromium, headless, driven by Playwright (never a browser build of Playwright's own);
    the screenshot folder made."""
    if not Path(CHROMIUM).exists():
        raise FileNotFoundError(f"{CHROMIUM} is missing: scripts/install.sh installs Debian's chromium "
                                "(or set QUILT_CHROMIUM)")
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


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
