"""Dashboard accounts (tenancy.members): invitation-only sign-up by default, an owner's invitation
joining its tenant with a role, password login beside the API-key login, reset links written to the
log without a mail server (single use), members who may make keys but not change budgets, removal
ending a member's sessions, and open sign-up creating a tenant when the operator allows it."""

from __future__ import annotations

import contextlib
import re
import time

import httpx
import pytest
from dashutil import csrf_of, login
from stackutil import second_api

from tenancy import login_limit

PASSWORD = "correct horse battery"


def _form_client(base_url: str, path: str) -> tuple[httpx.Client, str]:
    """A client that has opened a session-less form page (its double-submit CSRF cookie set)."""
    client = httpx.Client(base_url=base_url, timeout=60)
    page = client.get(path)
    return client, csrf_of(page.text)


def _csrf(client: httpx.Client) -> str:
    """The double-submit token a session-less form page last set (each such page sets a new one)."""
    return client.cookies.get("quilt_login_csrf")


def _invite(owner: httpx.Client, email: str, role: str = "member") -> str:
    token = csrf_of(owner.get("/dashboard/members").text)
    r = owner.post("/dashboard/members/invite", data={"email": email, "role": role, "csrf_token": token})
    assert r.status_code == 200, r.text[:500]
    return re.search(r'id="invite-link">([^<]+)<', r.text).group(1).split("invite=")[1]


def _join(stack, invite: str, password: str = PASSWORD) -> httpx.Client:
    client, token = _form_client(stack.base_url, f"/dashboard/signup?invite={invite}")
    r = client.post("/dashboard/signup", data={"invite": invite, "password": password, "csrf_token": token})
    assert r.status_code == 303, r.text[:500]
    return client


def _password_login(base_url: str, email: str, password: str) -> httpx.Response:
    client, token = _form_client(base_url, "/dashboard/login")
    return client.post("/dashboard/login/password", data={"email": email, "password": password, "csrf_token": token})


def _logged_token(stack, pattern: str, timeout_s: float = 10) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.findall(pattern, (stack.log_dir / "api.log").read_text())
        if found:
            return found[-1]
        time.sleep(0.1)
    raise AssertionError(f"{pattern} not in the API log")


def test_sign_up_is_by_invitation_unless_opened(stack):
    client, token = _form_client(stack.base_url, "/dashboard/login")
    closed = client.get("/dashboard/signup")
    assert closed.status_code == 403 and "by invitation" in closed.text
    token = client.cookies.get("quilt_login_csrf")  # the sign-up page set a new one
    r = client.post("/dashboard/signup", data={"email": "a@b.example", "password": PASSWORD, "tenant": "x",
                                               "csrf_token": token})
    assert r.status_code == 403
    assert client.post("/dashboard/signup", data={"invite": "made-up", "password": PASSWORD,
                                                  "csrf_token": token}).status_code == 403


def test_an_invited_member_joins_logs_in_and_has_a_members_rights(stack, tenant):
    email = f"dev-{time.time_ns()}@team.example"
    with contextlib.closing(login(stack, tenant.key)) as owner:
        invite = _invite(owner, email)
        assert email in (stack.log_dir / "api.log").read_text()  # no mail server: the link is logged
        member = _join(stack, invite)
        assert member.get("/dashboard/members").status_code == 200
        assert email in owner.get("/dashboard/members").text
        # Used once only.
        client, token = _form_client(stack.base_url, f"/dashboard/signup?invite={invite}")
        assert client.post("/dashboard/signup", data={"invite": invite, "password": PASSWORD,
                                                      "csrf_token": token}).status_code == 403

        page = member.get("/dashboard/keys").text
        made = member.post("/dashboard/keys", data={"name": "from-a-member", "csrf_token": csrf_of(page)})
        assert made.status_code == 200 and "new-key-secret" in made.text
        refused = member.post("/dashboard/account/budget", data={"monthly_usd": "5", "csrf_token": csrf_of(page)})
        assert refused.status_code == 403
        assert member.post("/dashboard/members/invite", data={"email": "x@y.example",
                                                              "csrf_token": csrf_of(page)}).status_code == 403
        audit = owner.get("/dashboard/account").text
        for action in ("member.invited", "member.joined", "key.created"):
            assert action in audit
        assert f"account:{email}" in audit

        # Logging in with the password works; a wrong one or an unknown address reads the same.
        assert _password_login(stack.base_url, email, PASSWORD).status_code == 303
        wrong, unknown = (_password_login(stack.base_url, email, "not the password"),
                          _password_login(stack.base_url, "nobody@team.example", PASSWORD))
        assert wrong.status_code == unknown.status_code == 401
        assert "wrong email or password" in wrong.text and "wrong email or password" in unknown.text

        # Removing the member ends their session at its next request.
        member_id = re.search(rf'data-email="{re.escape(email)}".*?name="member_id" value="([^"]+)"',
                              owner.get("/dashboard/members").text, re.S).group(1)
        r = owner.post("/dashboard/members/remove", data={"member_id": member_id,
                                                          "csrf_token": csrf_of(owner.get("/dashboard/members").text)})
        assert r.status_code == 303
        assert member.get("/dashboard/runs").status_code == 303  # back to the login page
        assert _password_login(stack.base_url, email, PASSWORD).status_code == 401
        member.close()


def test_a_password_reset_link_is_logged_and_works_once(stack, tenant):
    """A reset ends the account's sessions and spends its other reset links."""
    email = f"reset-{time.time_ns()}@team.example"
    with contextlib.closing(login(stack, tenant.key)) as owner:
        session = _join(stack, _invite(owner, email, role="owner"))
    pattern = rf"for {re.escape(email)}: \S+/dashboard/reset\?token=(\S+)"
    client, token = _form_client(stack.base_url, "/dashboard/forgot")
    earlier = None
    for address in (email, "nobody@team.example", email):  # the same answer for an unknown address
        r = client.post("/dashboard/forgot", data={"email": address,
                                                   "csrf_token": _csrf(client)})
        assert r.status_code == 200 and "forgot-sent" in r.text
        if earlier is None:
            earlier = _logged_token(stack, pattern)
    reset = _logged_token(stack, pattern)
    assert reset != earlier
    client, token = _form_client(stack.base_url, f"/dashboard/reset?token={reset}")
    short = client.post("/dashboard/reset", data={"token": reset, "password": "short", "csrf_token": _csrf(client)})
    assert short.status_code == 400 and "password" in short.text
    done = client.post("/dashboard/reset", data={"token": reset, "password": "a new long password", "csrf_token": _csrf(client)})
    assert done.status_code == 303
    again = client.post("/dashboard/reset", data={"token": reset, "password": "another long one!", "csrf_token": _csrf(client)})
    assert again.status_code == 403
    other = client.post("/dashboard/reset", data={"token": earlier, "password": "another long one!",
                                                  "csrf_token": _csrf(client)})
    assert other.status_code == 403  # the address's other link is spent too
    assert session.get("/dashboard/runs").status_code == 303  # the session from before the reset ended
    session.close()
    assert _password_login(stack.base_url, email, "a new long password").status_code == 303
    assert _password_login(stack.base_url, email, PASSWORD).status_code == 401


@pytest.mark.parametrize("password", ["x" * 201, "has a \x00 in it!!"])
def test_hostile_passwords_are_refused(stack, password):
    client, token = _form_client(stack.base_url, "/dashboard/login")
    r = client.post("/dashboard/login/password", data={"email": "a@b.example", "password": password,
                                                       "csrf_token": token})
    assert r.status_code == 400, r.text


def test_open_sign_up_creates_a_tenant_and_its_owner(stack, tmp_path):
    with second_api(stack, tmp_path, QUILT_SIGNUP="open") as url:
        email, name = f"founder-{time.time_ns()}@startup.example", f"startup-{time.time_ns()}"
        client, token = _form_client(url, "/dashboard/signup")
        bad = client.post("/dashboard/signup", data={"email": "not-an-address", "password": PASSWORD, "tenant": name,
                                                     "csrf_token": token})
        assert bad.status_code == 400 and "email" in bad.text
        r = client.post("/dashboard/signup", data={"email": email, "password": PASSWORD, "tenant": name,
                                                   "csrf_token": _csrf(client)})
        assert r.status_code == 303
        assert name in client.get("/dashboard/account").text
        assert "member.joined" in client.get("/dashboard/account").text
        other, other_token = _form_client(url, "/dashboard/signup")
        dup = other.post("/dashboard/signup", data={"email": email.upper(), "password": PASSWORD, "tenant": name + "-2",
                                                    "csrf_token": other_token})
        assert dup.status_code == 409, dup.text[:300]
        # An owner may set budgets.
        page = client.get("/dashboard/account").text
        assert client.post("/dashboard/account/budget", data={"monthly_usd": "5",
                                                              "csrf_token": csrf_of(page)}).status_code == 303


def test_an_owner_cannot_touch_another_tenants_members(stack):
    a, b = stack.create_tenant("mem-a"), stack.create_tenant("mem-b")
    email = f"a-{time.time_ns()}@team.example"
    with contextlib.closing(login(stack, a.key)) as owner_a, contextlib.closing(login(stack, b.key)) as owner_b:
        _join(stack, _invite(owner_a, email)).close()
        member_id = re.search(r'name="member_id" value="([^"]+)"', owner_a.get("/dashboard/members").text).group(1)
        assert email not in owner_b.get("/dashboard/members").text
        r = owner_b.post("/dashboard/members/remove", data={"member_id": member_id,
                                                            "csrf_token": csrf_of(owner_b.get("/dashboard/members").text)})
        assert r.status_code == 404
        assert email in owner_a.get("/dashboard/members").text


def test_failed_logins_are_braked_per_account_then_cleared_by_a_success(stack, tenant):
    """Ten wrong passwords for one account from one address brake that pair: the eleventh attempt
    answers 429 with Retry-After whatever the password (no Argon2 spent on it), while other accounts
    log in from the same client. A success before the limit clears the count."""
    email = f"brake-{time.time_ns()}@team.example"
    with contextlib.closing(login(stack, tenant.key)) as owner:
        _join(stack, _invite(owner, email)).close()
    for _ in range(9):
        assert _password_login(stack.base_url, email, "a wrong guess").status_code == 401
    assert _password_login(stack.base_url, email, PASSWORD).status_code == 303  # clears the count
    for _ in range(10):
        assert _password_login(stack.base_url, email, "a wrong guess").status_code == 401
    braked = _password_login(stack.base_url, email, PASSWORD)
    assert braked.status_code == 429 and 0 < int(braked.headers["Retry-After"]) <= 900
    assert "too many failed attempts from this account from this address" in braked.text
    # Another account from the same client is not braked by it.
    other = f"brake-other-{time.time_ns()}@team.example"
    with contextlib.closing(login(stack, tenant.key)) as owner:
        _join(stack, _invite(owner, other)).close()
    assert _password_login(stack.base_url, other, PASSWORD).status_code == 303


def test_a_client_address_is_braked_across_accounts_and_keys_but_not_by_reset_requests(stack, r, tmp_path):
    for key in r.scan_iter("quilt:brake:*"):  # the suite's own attempts from this address so far
        r.delete(key)
    with second_api(stack, tmp_path, QUILT_LOGIN_FAILURES_PER_ADDRESS="5") as url:
        for _ in range(4):  # reset requests are counted apart: they never brake a login
            client, token = _form_client(url, "/dashboard/forgot")
            assert client.post("/dashboard/forgot", data={"email": "x@team.example", "csrf_token": token}) \
                .status_code == 200
        for i in range(4):
            assert _password_login(url, f"nobody-{i}@team.example", "guess").status_code == 401
        client, token = _form_client(url, "/dashboard/login")
        assert client.post("/dashboard/login", data={"api_key": "tml-not-a-key", "csrf_token": token}).status_code \
            == 401
        # Five failed attempts from this address: a password and a key are refused now.
        assert _password_login(url, "someone@team.example", PASSWORD).status_code == 429
        client, token = _form_client(url, "/dashboard/login")
        refused = client.post("/dashboard/login", data={"api_key": "tml-not-a-key", "csrf_token": token})
        assert refused.status_code == 429 and "Retry-After" in refused.headers
        # Reset requests have a brake of their own, per address.
        client, token = _form_client(url, "/dashboard/forgot")
        assert client.post("/dashboard/forgot", data={"email": "x@team.example", "csrf_token": token}).status_code \
            == 200
        client, token = _form_client(url, "/dashboard/forgot")
        flood = client.post("/dashboard/forgot", data={"email": "y@team.example", "csrf_token": token})
        assert flood.status_code == 429 and "Retry-After" in flood.headers


def test_reset_requests_never_lock_the_owner_out(stack, tenant):
    email = f"reset-flood-{time.time_ns()}@team.example"
    with contextlib.closing(login(stack, tenant.key)) as owner:
        _join(stack, _invite(owner, email)).close()
    for _ in range(10):  # the per-account reset brake's limit (QUILT_LOGIN_FAILURES_PER_ACCOUNT)
        client, token = _form_client(stack.base_url, "/dashboard/forgot")
        assert client.post("/dashboard/forgot", data={"email": email, "csrf_token": token}).status_code == 200
    client, token = _form_client(stack.base_url, "/dashboard/forgot")
    assert client.post("/dashboard/forgot", data={"email": email, "csrf_token": token}).status_code == 429
    assert _password_login(stack.base_url, email, PASSWORD).status_code == 303


def test_concurrent_wrong_passwords_cannot_slip_past_the_limit(stack, tenant):
    """The brake is taken before the password is checked, atomically: of 25 concurrent guesses
    against a limit of 10, at most 10 are verified (401); the rest are 429."""
    from concurrent.futures import ThreadPoolExecutor

    email = f"race-{time.time_ns()}@team.example"
    with contextlib.closing(login(stack, tenant.key)) as owner:
        _join(stack, _invite(owner, email)).close()
    forms = [_form_client(stack.base_url, "/dashboard/login") for _ in range(25)]
    with ThreadPoolExecutor(25) as pool:
        codes = list(pool.map(lambda form: form[0].post("/dashboard/login/password", data={
            "email": email, "password": "a wrong guess", "csrf_token": form[1]}).status_code, forms))
    assert codes.count(401) <= 10 and codes.count(401) + codes.count(429) == 25, codes


def test_a_strangers_guesses_do_not_brake_the_owner_at_another_address(stack):
    import asyncio

    from core import redis_client
    from core.errors import QuotaExceeded

    account = f"owner-{time.time_ns()}@team.example"

    async def go():
        redis = redis_client.async_client(stack.redis_url)
        try:
            for _ in range(10):
                await login_limit.take(redis, "login", account=account, address="203.0.113.9")
            with pytest.raises(QuotaExceeded):
                await login_limit.take(redis, "login", account=account, address="203.0.113.9")
            await login_limit.take(redis, "login", account=account, address="198.51.100.7")  # the owner
            await login_limit.succeeded(redis, account=account, address="198.51.100.7")
        finally:
            await redis.aclose()
    asyncio.run(go())


def _submit_reset(client: httpx.Client, token: str, *, address: str | None = None,
                  password: str = "a new long password") -> httpx.Response:
    headers = {"X-Forwarded-For": address} if address else {}
    return client.post("/dashboard/reset", data={"token": token, "password": password, "csrf_token": _csrf(client)},
                       headers=headers)


def _reset_token(stack, tenant) -> tuple[str, str]:
    """(an account's email, a live reset token of it), asked for through the shared stack's API."""
    email = f"reset-brake-{time.time_ns()}@team.example"
    with contextlib.closing(login(stack, tenant.key)) as owner:
        _join(stack, _invite(owner, email)).close()
    client, token = _form_client(stack.base_url, "/dashboard/forgot")
    assert client.post("/dashboard/forgot", data={"email": email, "csrf_token": token}).status_code == 200
    return email, _logged_token(stack, rf"for {re.escape(email)}: \S+/dashboard/reset\?token=(\S+)")


def test_reset_submissions_with_a_bogus_token_are_braked_and_a_real_reset_is_not(stack, tenant):
    """Twelve guesses at one link from one address: ten are checked (403), then 429 with
    Retry-After whatever is sent, before any Argon2 time. Another link from the same address, a
    login and a real reset are not braked by it."""
    bogus = f"guess-{time.time_ns()}-" + "A" * 20
    client, _ = _form_client(stack.base_url, "/dashboard/reset")
    codes = [_submit_reset(client, bogus) for _ in range(12)]
    assert [c.status_code for c in codes] == [403] * 10 + [429] * 2, [c.status_code for c in codes]
    assert 0 < int(codes[-1].headers["Retry-After"]) <= 900
    assert "too many password resets for this reset link" in codes[-1].text
    assert _submit_reset(client, f"other-{time.time_ns()}").status_code == 403  # another link is checked
    email, token = _reset_token(stack, tenant)
    client, _ = _form_client(stack.base_url, f"/dashboard/reset?token={token}")
    assert _submit_reset(client, token).status_code == 303
    assert _password_login(stack.base_url, email, "a new long password").status_code == 303


def test_reset_submissions_are_braked_per_link_across_addresses_and_per_address_across_links(stack, tenant, tmp_path):
    """Behind a trusted proxy each guess can come from another address: one link is still braked
    (per link), and one address trying many links is braked (per address). Hostile tokens are
    counted like any other, never a 500; a real reset from an address of its own goes through."""
    _, token = _reset_token(stack, tenant)
    with second_api(stack, tmp_path, QUILT_TRUSTED_PROXIES="127.0.0.1", QUILT_LOGIN_FAILURES_PER_ADDRESS="5") as url:
        client, _ = _form_client(url, "/dashboard/reset")
        one_link = f"rotated-{time.time_ns()}-" + "B" * 20
        codes = [_submit_reset(client, one_link, address=f"203.0.113.{i}").status_code for i in range(1, 13)]
        assert codes == [403] * 10 + [429] * 2, codes

        many = [_submit_reset(client, f"guess-{i}-{time.time_ns()}", address="198.51.100.9") for i in range(6)]
        assert [r.status_code for r in many] == [403] * 5 + [429], [r.status_code for r in many]
        assert "too many password resets from this address" in many[-1].text and many[-1].headers["Retry-After"]

        # Refused as input (400: NUL, too long) or checked as a link (403), never a 500.
        for i, hostile in enumerate(["\x00" * 40, "x" * 100, "y" * 101, "é\x00" + "%ED%B3%BF" * 10, " " * 60]):
            r = _submit_reset(client, hostile, address=f"192.0.2.{100 + i}")
            assert r.status_code in (400, 403), (hostile, r.status_code, r.text[:300])
        lone = client.post("/dashboard/reset", content=b"token=%ED%B3%BFabc&password=a+new+long+password&csrf_token="
                           + _csrf(client).encode(), headers={"Content-Type": "application/x-www-form-urlencoded",
                                                              "X-Forwarded-For": "192.0.2.120"})
        assert lone.status_code in (400, 403), lone.text[:300]

        client, _ = _form_client(url, f"/dashboard/reset?token={token}")
        assert _submit_reset(client, token, address="192.0.2.200").status_code == 303
