"""Links from configuration (api.links): with QUILT_PUBLIC_URL set, a forged Host is refused at the
door and every link (here a password-reset link, mailed to the log without SMTP) starts with the
public URL; https adds HSTS; forwarded headers count only from QUILT_TRUSTED_PROXIES."""

from __future__ import annotations

import re
import time

import httpx
from dashutil import csrf_of
from stackutil import second_api


def _reset_link(log_path, email: str, timeout_s: float = 10) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.findall(rf"for {re.escape(email)}: (\S+)", log_path.read_text())
        if found:
            return found[-1]
        time.sleep(0.1)
    raise AssertionError("no reset link in the log")


def _account(stack, email: str) -> None:
    """A member account (a tenant of its own) whose password can be reset."""
    import asyncio

    import psycopg
    from psycopg.rows import dict_row

    from tenancy import members

    async def go():
        async with await psycopg.AsyncConnection.connect(stack.database_url, row_factory=dict_row,
                                                         autocommit=True) as conn:
            await members.sign_up(conn, email, members.hash_password("a long enough password"),
                                  f"linked-{time.time_ns()}")
    asyncio.run(go())


def test_links_come_from_the_public_url_and_forged_hosts_are_refused(stack, tmp_path):
    email = f"linked-{time.time_ns()}@team.example"
    _account(stack, email)
    with second_api(stack, tmp_path, QUILT_PUBLIC_URL="http://quilt.example.test") as url:
        forged = httpx.get(url + "/dashboard/forgot", headers={"Host": "attacker.example"})
        assert forged.status_code == 421
        assert httpx.get(url + "/api/v1/healthz", headers={"Host": "10.0.0.7:8000"}).status_code in (200, 503)
        with httpx.Client(base_url=url, headers={"Host": "quilt.example.test"}) as client:
            form = client.get("/dashboard/forgot")
            assert form.status_code == 200 and "strict-transport-security" not in form.headers
            sent = client.post("/dashboard/forgot", data={"email": email, "csrf_token": csrf_of(form.text)})
            assert sent.status_code == 200, sent.text
        log = next(tmp_path.glob("api-*.log"))
        assert _reset_link(log, email).startswith("http://quilt.example.test/dashboard/reset?token=")


def test_an_https_public_url_adds_hsts_and_secure_cookies(stack, tmp_path):
    with second_api(stack, tmp_path, QUILT_PUBLIC_URL="https://quilt.example.test") as url:
        r = httpx.get(url + "/api/v1/get_server_capabilities", headers={"Host": "quilt.example.test"})
        assert r.status_code == 200 and "max-age=" in r.headers["strict-transport-security"]
        # Secure cookies though this connection is plain http (and claims to be, untrusted).
        page = httpx.get(url + "/dashboard/login", headers={"Host": "quilt.example.test", "X-Forwarded-Proto": "http"})
        assert page.status_code == 200
        assert "secure" in page.headers.get("set-cookie", "").lower()
