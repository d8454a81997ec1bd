"""Roles that hold (tenancy.roles, issue 46 item 2): keys carry a role capped at their maker's; a
member's key cannot change budgets or revoke an owner's key; a key may lower its own budget but not
raise or clear it; read-only keys read and nothing else; removing a member revokes the keys they
made at once; operator power is an operator tenant's owners', not its members'; owners list and
revoke invitations. Before this change every one of the HTTP checks below passed the attack."""

from __future__ import annotations

import contextlib
import re
import time

import httpx
import pytest
from dashutil import csrf_of, login, operator_key
from test_members import _invite, _join

from core.errors import Forbidden, InvalidInput
from tenancy import roles


@pytest.mark.parametrize("asked,creator,ok", [
    ("owner", "owner", True), ("member", "owner", True), ("read_only", "owner", True),
    ("owner", "member", False), ("member", "member", True), ("read_only", "member", True),
    ("owner", "read_only", False), ("member", "read_only", False), ("read_only", "read_only", True),
])
def test_a_key_holds_at_most_its_makers_role(asked, creator, ok):
    if ok:
        assert roles.key_role(asked, creator) == asked
    else:
        with pytest.raises(Forbidden, match="at most its maker's role"):
            roles.key_role(asked, creator)


@pytest.mark.parametrize("asked", ["admin", "", "OWNER", "owner\x00", "x" * 1000])
def test_unknown_roles_are_named(asked):
    with pytest.raises(InvalidInput, match="role: one of"):
        roles.key_role(asked, "owner")


@pytest.mark.parametrize("role,method,path,ok", [
    ("read_only", "GET", "/api/v1/training_runs", True),
    ("read_only", "POST", "/api/v1/retrieve_future", True),
    ("read_only", "POST", "/api/v1/forward_backward", False),
    ("read_only", "POST", "/api/v1/create_session", False),
    ("read_only", "POST", "/api/v1/asample", False),
    ("read_only", "PUT", "/api/v1/quilt/budgets", False),
    ("read_only", "DELETE", "/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}", False),
    ("read_only", "POST", "/api/v1/auth/token", True),          # a token holds no more than its key
    ("read_only", "DELETE", "/api/v1/auth/apikey/me", True),     # logging out only removes power
    ("read_only", "DELETE", "/api/v1/auth/token", False),
    ("member", "POST", "/api/v1/forward_backward", True),
    ("owner", "DELETE", "/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}", True),
])
def test_read_only_callers_make_only_reading_calls(role, method, path, ok):
    assert roles.may_call(role, method, path) is ok


@pytest.mark.parametrize("role,own,current,new,refused", [
    ("owner", False, None, None, None),
    ("owner", False, 5, 50, None),
    ("member", False, None, 5, "only an owner"),
    ("read_only", False, None, 5, "only an owner"),
    ("member", True, 10, 5, None),  # lowering its own
    ("member", True, None, 5, None),  # setting one where there was none lowers it
    ("member", True, 10, 10, None),
    ("member", True, 10, 11, "not raise"),
    ("member", True, 10, None, "cannot clear"),
    ("owner", True, 10, 20, "not raise"),  # an owner's key too: an owner (another key, the dashboard) raises it
])
def test_budget_changes(role, own, current, new, refused):
    why = roles.budget_refusal(role, own, current, new)
    assert (why is None) if refused is None else (refused in why)


@pytest.mark.parametrize("role,caller,maker,ok", [
    ("owner", None, "m1", True), ("owner", "m2", None, True),
    ("member", "m1", "m1", True), ("member", "m1", "m2", False), ("member", "m1", None, False),
    ("member", None, None, False), ("read_only", "m1", "m1", True),
])
def test_who_may_revoke_a_key(role, caller, maker, ok):
    assert roles.may_revoke(role, caller, maker) is ok


# ------------------------------------------------------------------------------ through HTTP

def _make_key(client: httpx.Client, role: str | None = None) -> tuple[httpx.Response, str | None]:
    page = client.get("/dashboard/keys").text
    data = {"name": f"k-{time.time_ns()}", "csrf_token": csrf_of(page)}
    if role is not None:
        data["role"] = role
    r = client.post("/dashboard/keys", data=data)
    found = re.search(r'id="new-key-secret">([^<]+)<', r.text)
    return r, found.group(1) if found else None


def _api(stack, key: str) -> httpx.Client:
    return httpx.Client(base_url=stack.base_url, timeout=60, headers={"X-API-Key": key})


def _budget(api: httpx.Client, usd: str | None, prefix: str | None = None) -> httpx.Response:
    return api.put("/api/v1/quilt/budgets", json={"monthly_usd": usd, "api_key_prefix": prefix})


def test_a_members_key_holds_a_members_power(stack, tenant):
    email = f"role-{time.time_ns()}@team.example"
    with contextlib.closing(login(stack, tenant.key)) as owner:
        member = _join(stack, _invite(owner, email))
        refused, _ = _make_key(member, "owner")
        assert refused.status_code == 403 and "a key holds at most" in refused.text
        made, secret = _make_key(member)
        assert made.status_code == 200 and secret and "New member key" in made.text
        prefix = secret[:12]
        with _api(stack, secret) as api:
            r = _budget(api, "100")  # the tenant's budget: owners only
            assert r.status_code == 403 and "only an owner" in r.json()["error"]
            assert _budget(api, "20", prefix).status_code == 200  # its own, first set: lowers from none
            assert _budget(api, "10", prefix).status_code == 200
            raised = _budget(api, "30", prefix)
            assert raised.status_code == 403 and "not raise" in raised.json()["error"]
            cleared = _budget(api, None, prefix)
            assert cleared.status_code == 403 and "cannot clear" in cleared.json()["error"]
        with _api(stack, tenant.key) as owner_api:  # an owner raises and clears it
            assert _budget(owner_api, "50", prefix).status_code == 200
            assert _budget(owner_api, None, prefix).status_code == 200

        # The member may not revoke the owner's key, nor replace the card; their own key, yes.
        page = member.get("/dashboard/keys").text
        owner_prefix = tenant.key[:12]
        assert 'value="%s"' % owner_prefix not in page  # no revoke button on someone else's key
        r = member.post("/dashboard/keys/revoke", data={"prefix": owner_prefix, "csrf_token": csrf_of(page)})
        assert r.status_code == 403
        assert member.post("/dashboard/billing/card", data={"csrf_token": csrf_of(page)}).status_code == 403
        with _api(stack, tenant.key) as owner_api:
            assert owner_api.get("/api/v1/quilt/budgets").status_code == 200  # still working

        # Logging in to the dashboard with the member's key gives a member's session, not an owner's.
        with contextlib.closing(login(stack, secret)) as by_key:
            page = by_key.get("/dashboard/members").text
            assert by_key.post("/dashboard/members/invite", data={"email": "x@y.example",
                                                                   "csrf_token": csrf_of(page)}).status_code == 403

        # Removing the member revokes the keys they made, from the very next call.
        other, other_secret = _make_key(member, "read_only")
        member_id = re.search(rf'data-email="{re.escape(email)}".*?name="member_id" value="([^"]+)"',
                              owner.get("/dashboard/members").text, re.S).group(1)
        with _api(stack, secret) as api:
            assert api.get("/api/v1/quilt/budgets").status_code == 200
            token = csrf_of(owner.get("/dashboard/members").text)
            r = owner.post("/dashboard/members/remove", data={"member_id": member_id, "csrf_token": token})
            assert r.status_code == 303
            gone = api.get("/api/v1/quilt/budgets")
            assert gone.status_code == 401 and "revoked" in gone.json()["error"]
        with _api(stack, other_secret) as api:
            assert api.get("/api/v1/quilt/budgets").status_code == 401
        assert member.get("/dashboard/runs").status_code == 303
        audit = owner.get("/dashboard/account").text
        assert "member.removed" in audit and secret[:12] in audit
        member.close()


def test_a_read_only_key_reads_and_changes_nothing(stack, tenant):
    with contextlib.closing(login(stack, tenant.key)) as owner:
        made, secret = _make_key(owner, "read_only")
        assert made.status_code == 200
    with _api(stack, secret) as api:
        assert api.get("/api/v1/quilt/budgets").status_code == 200
        assert api.get("/api/v1/training_runs").status_code == 200
        assert api.post("/api/v1/retrieve_future", json={"request_id": "nope"}).status_code == 404
        for path, body in (("/api/v1/create_session", {"tags": [], "user_metadata": {}, "sdk_version": "0"}),
                           ("/api/v1/create_model", {"session_id": "s", "base_model": "b"}),
                           ("/api/v1/asample", {}), ("/v1/completions", {"model": "m", "prompt": "hi"})):
            r = api.post(path, json=body)
            assert r.status_code == 403 and "it may read" in r.text, (path, r.status_code, r.text)
        r = _budget(api, "1")
        assert r.status_code == 403
    with contextlib.closing(login(stack, secret)) as viewer:
        refused, _ = _make_key(viewer, "member")
        assert refused.status_code == 403
        made, _ = _make_key(viewer)  # a read-only key of its own, yes
        assert made.status_code == 200 and "New read-only key" in made.text


def test_operator_power_is_the_operator_tenants_owners(stack, tenant):
    op_key = operator_key(stack)
    email = f"opmember-{time.time_ns()}@ops.example"
    with contextlib.closing(login(stack, op_key)) as op_owner:
        assert op_owner.get("/dashboard/ops").status_code == 200
        member = _join(stack, _invite(op_owner, email))
        assert member.get("/dashboard/ops").status_code == 403
        assert member.get("/dashboard/tenants").status_code == 403
        _, member_key = _make_key(member)
        member.close()
    with _api(stack, member_key) as api:
        r = api.post(f"/api/v1/quilt/tenants/{tenant.name}/suspend", json={"reason": "because"})
        assert r.status_code == 403
        assert api.get("/api/v1/quilt/audit", params={"tenant": tenant.name}).status_code == 403
    with _api(stack, op_key) as api:
        assert api.get("/api/v1/quilt/audit", params={"tenant": tenant.name}).status_code == 200


def test_owners_list_and_revoke_invitations(stack, tenant):
    email = f"inv-{time.time_ns()}@team.example"
    with contextlib.closing(login(stack, tenant.key)) as owner:
        invite = _invite(owner, email, role="read_only")
        page = owner.get("/dashboard/members").text
        row = re.search(rf'<tr data-email="{re.escape(email)}">.*?name="invitation_id" value="(\d+)"', page, re.S)
        assert row and "read-only" in page
        r = owner.post("/dashboard/members/invitations/revoke", data={"invitation_id": row.group(1),
                                                                      "csrf_token": csrf_of(page)})
        assert r.status_code == 303
        assert email not in owner.get("/dashboard/members").text
        again = owner.post("/dashboard/members/invitations/revoke",
                           data={"invitation_id": row.group(1), "csrf_token": csrf_of(page)})
        assert again.status_code == 404
    client = httpx.Client(base_url=stack.base_url, timeout=60)
    client.get(f"/dashboard/signup?invite={invite}")
    r = client.post("/dashboard/signup", data={"invite": invite, "password": "correct horse battery",
                                               "csrf_token": client.cookies.get("quilt_login_csrf")})
    assert r.status_code == 403
    client.close()


def test_another_tenants_owner_cannot_revoke_an_invitation(stack):
    a, b = stack.create_tenant("inv-a"), stack.create_tenant("inv-b")
    with contextlib.closing(login(stack, a.key)) as owner_a, contextlib.closing(login(stack, b.key)) as owner_b:
        _invite(owner_a, f"x-{time.time_ns()}@team.example")
        invitation = re.search(r'name="invitation_id" value="(\d+)"', owner_a.get("/dashboard/members").text).group(1)
        page = owner_b.get("/dashboard/members").text
        assert 'name="invitation_id"' not in page
        r = owner_b.post("/dashboard/members/invitations/revoke", data={"invitation_id": invitation,
                                                                        "csrf_token": csrf_of(page)})
        assert r.status_code == 404
        assert 'name="invitation_id"' in owner_a.get("/dashboard/members").text
