"""API keys: every call needs a valid, unrevoked key."""

from __future__ import annotations

from core import db
from tenancy.keys import create_key, revoke_key


def test_missing_key_is_401_with_a_clear_message(stack):
    r = stack.http(None).post("/create_session", json={})
    assert r.status_code == 401
    assert "X-API-Key" in r.json()["detail"]
    assert r.json()["category"] == "user"
    assert r.headers["X-Request-ID"] == r.json()["request_id"]


def test_unknown_key_is_401(stack):
    r = stack.http("tml-not-a-real-key").post("/create_session", json={})
    assert r.status_code == 401
    assert "unknown API key" in r.json()["detail"]


def test_valid_key_works_and_revoked_key_is_401(stack, tenant):
    with db.connect(stack.database_url) as conn:
        secret, info = create_key(conn, tenant.tenant_id, name="temp")
    assert secret.startswith("tml-")
    assert stack.http(secret).post("/create_session", json={}).status_code == 200
    with db.connect(stack.database_url) as conn:
        revoke_key(conn, info.prefix)
    r = stack.http(secret).post("/create_session", json={})
    assert r.status_code == 401
    assert "revoked" in r.json()["detail"]
    # The tenant's other key is untouched.
    assert stack.http(tenant.key).post("/create_session", json={}).status_code == 200


def test_keys_are_stored_hashed(stack, tenant):
    with db.connect(stack.database_url) as conn:
        rows = conn.execute("SELECT key_hash, prefix FROM api_keys WHERE tenant_id = %s", (tenant.tenant_id,)).fetchall()
    assert rows and all(tenant.key.encode() not in bytes(r["key_hash"]) for r in rows)
    assert all(len(r["prefix"]) < len(tenant.key) for r in rows)
