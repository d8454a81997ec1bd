"""API keys: shown once, stored as a SHA-256 hash.

A fast hash is right here (not bcrypt/argon2): keys carry 256 random bits, so there is nothing to
brute-force, and an exact-match index on the hash keeps authentication one indexed lookup.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime

import psycopg

from core import ids
from core.errors import NotFound

PREFIX_LEN = 12  # "tml-" plus 8 characters: enough to tell keys apart in a listing


def hash_key(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class KeyInfo:
    id: str
    tenant_id: str
    prefix: str
    name: str
    created_at: datetime
    revoked_at: datetime | None


def create_key(conn: psycopg.Connection, tenant_id: str, name: str = "") -> tuple[str, KeyInfo]:
    """Create a key for a tenant; returns (the secret, shown once; its record)."""
    secret = ids.new_api_key()
    row = conn.execute(
        "INSERT INTO api_keys (id, tenant_id, prefix, key_hash, name) VALUES (%s, %s, %s, %s, %s) "
        "RETURNING id, tenant_id, prefix, name, created_at, revoked_at",
        (ids.new_key_id(), tenant_id, secret[:PREFIX_LEN], hash_key(secret), name),
    ).fetchone()
    return secret, KeyInfo(**row)


def list_keys(conn: psycopg.Connection, tenant_id: str) -> list[KeyInfo]:
    rows = conn.execute(
        "SELECT id, tenant_id, prefix, name, created_at, revoked_at FROM api_keys "
        "WHERE tenant_id = %s ORDER BY created_at",
        (tenant_id,),
    ).fetchall()
    return [KeyInfo(**r) for r in rows]


def revoke_key(conn: psycopg.Connection, prefix: str, tenant_id: str | None = None) -> KeyInfo:
    """Revoke the key with this prefix (optionally only within one tenant)."""
    rows = conn.execute(
        "UPDATE api_keys SET revoked_at = now() WHERE prefix = %s AND revoked_at IS NULL "
        "AND (%s::text IS NULL OR tenant_id = %s) "
        "RETURNING id, tenant_id, prefix, name, created_at, revoked_at",
        (prefix, tenant_id, tenant_id),
    ).fetchall()
    if not rows:
        raise NotFound(f"no active API key with prefix {prefix!r}", field="prefix")
    return KeyInfo(**rows[0])
