"""The attacks of issue 46, tried through HTTP against the embedded stack: each probe is one call an
attacker would make, and the answer that shows it failed. Attacks that need a flow rather than one
call are probed where their capability is tested:

| attack | probed in |
| --- | --- |
| a forged Host mails a victim a link to the attacker's host | test_public_url.py |
| reset requests lock the owner out; 25 concurrent guesses pass a limit of 10; guesses brake the owner | test_members.py (brakes) |
| a member mints a key and becomes an owner; a removed member's keys keep working; members revoke owners' keys or replace the card; every member of an operator tenant is an operator | test_roles.py |
| 12 concurrent create_model with room for 2 admit 3; sessions unbounded | test_quota_races.py |
| one tenant's long-polls take every Redis connection; checkpoint and Redis bytes unbounded | test_tenant_bounds.py |
| an OpenAI caller who left keeps the engine busy; a huge prompt is tokenized | test_openai_compat.py |
| signed URLs outlive revocation, suspension and the signing key; a database copy signs links | test_checkpoint_downloads.py |
| a merged download builds every dense delta in the API process | bench/merge_memory.py, test_merged_export.py |
| tenants time each other through the prefix cache or speculation drafts | test_gen_engine.py, test_gen_speculation.py |
| fixed credentials, passwordless Redis, no NetworkPolicy | test_compose.py, test_k8s_manifests.py |
"""

from __future__ import annotations

import pytest

from core import db
from tenancy.keys import create_key

KEYED_POSTS = ["/api/v1/create_session", "/api/v1/forward_backward", "/api/v1/asample", "/api/v1/quilt/estimate",
               "/v1/completions", "/api/v1/retrieve_future"]


@pytest.fixture(scope="module")
def keys(stack):
    victim, other = stack.create_tenant("probe-victim"), stack.create_tenant("probe-other")
    with db.connect(stack.database_url) as conn:
        member, _ = create_key(conn, victim.tenant_id, name="member", role="member")
        reader, _ = create_key(conn, victim.tenant_id, name="reader", role="read_only")
    with stack.http(victim.key) as client:
        session = client.post("/create_session", json={}).json()["session_id"]
    return {"owner": victim.key, "member": member, "reader": reader, "other": other.key, "victim": victim,
            "session": session}


@pytest.mark.parametrize("path", KEYED_POSTS)
@pytest.mark.parametrize("body", [b'{"x": "\\u0000"}', b'{"x": "\\ud800"}', b"[" * 10_000, b"{" + b" " * (2 << 20)])
def test_anonymous_calls_are_401_whatever_the_body(stack, path, body):
    import httpx

    for headers in ({}, {"X-API-Key": "tml-forged"}, {"Authorization": "Bearer tml-forged"}):
        r = httpx.post(stack.base_url + path, content=body, headers={"Content-Type": "application/json", **headers},
                       timeout=60)
        assert r.status_code == 401, (path, headers, r.status_code, r.text[:200])


@pytest.mark.parametrize(("who", "method", "path", "body", "status"), [
    ("reader", "POST", "/create_session", {}, 403),  # read-only keys change nothing
    ("reader", "PUT", "/quilt/budgets", {"monthly_usd": "1"}, 403),
    ("member", "PUT", "/quilt/budgets", {"monthly_usd": None}, 403),  # only owners set the tenant's budget
    ("member", "POST", "/quilt/tenants/probe-other/suspend", {"reason": "x"}, 403),
    ("owner", "POST", "/quilt/tenants/probe-other/suspend", {"reason": "x"}, 403),  # not an operator tenant
    ("member", "GET", "/quilt/audit?tenant=probe-other", None, 403),
    ("other", "GET", "/sessions/{session}", None, 404),  # another tenant's session is as if missing
    ("owner", "POST", "/create_session", {"user_metadata": {"x": "y" * (4 << 20)}}, 400),
    ("owner", "POST", "/create_session", {"tags": ["t" * 129]}, 400),
    ("owner", "POST", "/save_weights", {"model_id": "x", "seq_id": 1, "path": ".."}, 400),
    ("owner", "GET", "/training_runs/x/checkpoints/weights/%2E%2E/archive", None, 404),  # no such name can exist
])
def test_a_key_does_no_more_than_its_role_and_tenant_allow(stack, keys, who, method, path, body, status):
    with stack.http(keys[who]) as client:
        r = client.request(method, path.format(session=keys["session"]), json=body)
    assert r.status_code == status, (who, method, path, r.status_code, r.text[:300])
    assert r.status_code < 500
