"""API keys: shown once, stored as a SHA-256 hash.

A fast hash is right here (not bcrypt/argon2): keys carry 256 random bits, so there is nothing to
brute-force, and an exact-match index on the hash keeps authentication one indexed lookup.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime

import psycopg
from psycopg.rows import DictRow

from core import db, ids
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
    role: str = "owner"  # tenancy.roles
    member_id: str | None = None  # the member account that made it (None: the CLI or a key)
    created_by: str = "cli"  # the maker as the audit log names it


_FIELDS = "id, tenant_id, prefix, name, created_at, revoked_at, role, member_id, created_by"
_RETURNING = f"RETURNING {_FIELDS}"
_CREATE = ("INSERT INTO api_keys (id, tenant_id, prefix, key_hash, name, role, member_id, created_by) "
           f"VALUES (%s, %s, %s, %s, %s, %s, %s, %s) {_RETURNING}")
_LIST = f"SELECT {_FIELDS} FROM api_keys WHERE tenant_id = %s ORDER BY created_at"
_REVOKE = ("UPDATE api_keys SET revoked_at = now() WHERE prefix = %s AND revoked_at IS NULL "
           f"AND (%s::text IS NULL OR tenant_id = %s) {_RETURNING}")


def _new_secret(tenant_id: str, name: str, role: str, member_id: str | None, created_by: str) -> tuple[str, tuple]:
    secret = ids.new_api_key()
    return secret, (ids.new_key_id(), tenant_id, secret[:PREFIX_LEN], hash_key(secret), name, role, member_id,
                    created_by)


def _revoked(rows: list[dict], prefix: str) -> KeyInfo:
    if not rows:
        raise NotFound(f"no active API key with prefix {prefix!r}", field="prefix")
    return KeyInfo(**rows[0])


def create_key(conn: psycopg.Connection[DictRow], tenant_id: str, name: str = "", role: str = "owner") -> tuple[str, KeyInfo]:
    """Create a key for a tenant (the CLI's: an owner's unless `role` says less); returns (the
    secret, shown once; its record)."""
    secret, params = _new_secret(tenant_id, name, role, None, "cli")
    return secret, KeyInfo(**db.one(conn.execute(_CREATE, params).fetchone()))


def list_keys(conn: psycopg.Connection[DictRow], tenant_id: str) -> list[KeyInfo]:
    return [KeyInfo(**r) for r in conn.execute(_LIST, (tenant_id,)).fetchall()]


def revoke_key(conn: psycopg.Connection[DictRow], prefix: str, tenant_id: str | None = None) -> KeyInfo:
    """Revoke the key with this prefix (optionally only within one tenant)."""
    return _revoked(conn.execute(_REVOKE, (prefix, tenant_id, tenant_id)).fetchall(), prefix)


# The API's async connections (the dashboard's key page).

async def create_key_async(conn: psycopg.AsyncConnection[DictRow], tenant_id: str, name: str, *, role: str,
                           member_id: str | None, created_by: str) -> tuple[str, KeyInfo]:
    """A key made by a caller (the dashboard): `role` already capped at the caller's
    (tenancy.roles.key_role), `member_id` the account it answers to."""
    secret, params = _new_secret(tenant_id, name, role, member_id, created_by)
    cur = await conn.execute(_CREATE, params)
    return secret, KeyInfo(**db.one(await cur.fetchone()))


async def list_keys_async(conn: psycopg.AsyncConnection[DictRow], tenant_id: str) -> list[KeyInfo]:
    """Async form of `list_keys`."""
    cur = await conn.execute(_LIST, (tenant_id,))
    return [KeyInfo(**r) for r in await cur.fetchall()]


async def key_by_prefix_async(conn: psycopg.AsyncConnection[DictRow], prefix: str, tenant_id: str) -> KeyInfo:
    """The active key of this tenant with this prefix (NotFound otherwise, another tenant's too)."""
    cur = await conn.execute(f"SELECT {_FIELDS} FROM api_keys WHERE prefix = %s AND tenant_id = %s "
                             "AND revoked_at IS NULL", (prefix, tenant_id))
    return _revoked(await cur.fetchall(), prefix)


async def own_key_async(conn: psycopg.AsyncConnection[DictRow], key_id: str, tenant_id: str) -> tuple[KeyInfo, str | None]:
    """The calling key's record (by its id, within its tenant) and the email of the member account
    that made it (None for a key the CLI made)."""
    cur = await conn.execute(f"SELECT {', '.join('k.' + f for f in _FIELDS.split(', '))}, m.email "
                             "FROM api_keys k LEFT JOIN members m ON m.id = k.member_id "
                             "WHERE k.id = %s AND k.tenant_id = %s AND k.revoked_at IS NULL", (key_id, tenant_id))
    row = await cur.fetchone()
    if row is None:
        raise NotFound("this API key is not active", field="X-API-Key")
    email = row.pop("email")
    return KeyInfo(**row), email


async def revoke_own_key_async(conn: psycopg.AsyncConnection[DictRow], key_id: str, tenant_id: str) -> KeyInfo:
    """Revoke the calling key itself (by id, within its tenant)."""
    cur = await conn.execute("UPDATE api_keys SET revoked_at = now() WHERE id = %s AND tenant_id = %s "
                             f"AND revoked_at IS NULL {_RETURNING}", (key_id, tenant_id))
    row = await cur.fetchone()
    if row is None:
        raise NotFound("this API key is not active", field="X-API-Key")
    return KeyInfo(**row)


async def revoke_key_async(conn: psycopg.AsyncConnection[DictRow], prefix: str, tenant_id: str) -> KeyInfo:
    """Async form of `revoke_key`, always within one tenant (another tenant's key is 404)."""
    cur = await conn.execute(_REVOKE, (prefix, tenant_id, tenant_id))
    return _revoked(await cur.fetchall(), prefix)


async def revoke_member_keys(conn: psycopg.AsyncConnection[DictRow], member_id: str) -> list[str]:
    """Revoke every active key a member account made (their removal); returns the prefixes."""
    cur = await conn.execute("UPDATE api_keys SET revoked_at = now() WHERE member_id = %s AND revoked_at IS NULL "
                             "RETURNING prefix", (member_id,))
    return [r["prefix"] for r in await cur.fetchall()]
