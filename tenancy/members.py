"""Dashboard accounts: people who log in with an email and a password, each a member of one tenant
as `owner` (sets budgets, invites and removes members, replaces the card), `member` (trains,
samples, makes keys up to its role) or `read_only` (tenancy.roles). Logging in with an API key
keeps working and acts with the key's role.

Passwords are hashed with Argon2id (argon2-cffi's defaults). Sign-up is by invitation unless the
operator opens it (`QUILT_SIGNUP=open`: anyone may create a tenant and become its owner).
Invitations and password resets are single-use tokens that expire, kept as SHA-256 hashes;
the link is mailed when `QUILT_SMTP_URL` is set and written to the API's log otherwise.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import secrets
import smtplib
from email.message import EmailMessage
from urllib.parse import urlsplit

import psycopg
from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerifyMismatchError
from psycopg.rows import DictRow

from core import db, ids
from core.errors import Conflict, Forbidden, InvalidInput, NotFound, Unauthenticated
from core.settings import get_api_settings
from tenancy.keys import revoke_member_keys
from tenancy.tenants import create_tenant_async

log = logging.getLogger("quilt.members")

MIN_PASSWORD, MAX_PASSWORD = 10, 200
INVITE_TTL_S, RESET_TTL_S = 7 * 86_400, 3_600
_EMAIL = re.compile(r"^[^@\s]{1,64}@[^@\s]+\.[^@\s]+$")
_hasher = PasswordHasher()
# Verifying against this when an address is unknown costs what a real check costs: the answer's
# timing does not tell which addresses have accounts.
_DUMMY_HASH = _hasher.hash(secrets.token_urlsafe(16))


def check_email(email: str) -> str:
    email = email.strip().lower()
    if len(email) > 254 or not _EMAIL.match(email):
        raise InvalidInput("email: not an email address", field="email")
    return email


def hash_password(password: str) -> str:
    """Argon2id of a password that meets the policy (InvalidInput naming `password` otherwise)."""
    if not MIN_PASSWORD <= len(password) <= MAX_PASSWORD:
        raise InvalidInput(f"password: use {MIN_PASSWORD} to {MAX_PASSWORD} characters", field="password")
    return _hasher.hash(password)


def _verify(stored: str, password: str) -> bool:
    try:
        return _hasher.verify(stored, password)
    except (VerifyMismatchError, InvalidHashError):
        return False


_argon2_slots: asyncio.Semaphore | None = None


async def argon2(fn, *args):
    """`fn(*args)` (a hash or a check, tens of milliseconds of CPU) in a thread, at most
    QUILT_ARGON2_CONCURRENCY at once: the event loop never runs one, and a burst of logins queues
    here instead of taking every thread."""
    global _argon2_slots
    if _argon2_slots is None:
        _argon2_slots = asyncio.Semaphore(get_api_settings().argon2_concurrency)
    async with _argon2_slots:
        return await asyncio.to_thread(fn, *args)


def _token_hash(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


# ------------------------------------------------------------------------------- accounts

async def sign_up(conn: psycopg.AsyncConnection[DictRow], email: str, password_hash: str, tenant_name: str) -> dict:
    """Open sign-up: a new tenant and its first owner (the caller commits)."""
    tenant = await create_tenant_async(conn, tenant_name)
    member = await _insert(conn, tenant.id, email, password_hash, "owner")
    return {**member, "tenant_name": tenant.name}


async def accept_invite(conn: psycopg.AsyncConnection[DictRow], token: str, password_hash: str) -> dict:
    """Join the tenant an invitation names, with its role (once; the caller commits)."""
    row = await _use_token(conn, token, "invite")
    if row is None:
        raise Forbidden("this invitation is unknown, used or expired; ask an owner for a new one", field="invite")
    return await _insert(conn, row["tenant_id"], row["email"], password_hash, row["role"])


async def _insert(conn, tenant_id: str, email: str, password_hash: str, role: str) -> dict:
    try:
        async with conn.transaction():
            cur = await conn.execute(
                "INSERT INTO members (id, tenant_id, email, password_hash, role) VALUES (%s, %s, %s, %s, %s) "
                "RETURNING id, tenant_id, email, role", (ids.new_member_id(), tenant_id, email, password_hash, role))
            return await cur.fetchone()
    except psycopg.errors.UniqueViolation:
        raise Conflict(f"{email} already has an account; log in or reset its password", field="email") from None


async def log_in(conn: psycopg.AsyncConnection[DictRow], email: str, password: str) -> dict:
    """The member with this email and password (Unauthenticated otherwise, the same for both)."""
    row = await (await conn.execute("SELECT id, tenant_id, email, role, password_hash FROM members "
                                    "WHERE lower(email) = %s AND removed_at IS NULL", (email,))).fetchone()
    ok = await argon2(_verify, row["password_hash"] if row else _DUMMY_HASH, password)
    if row is None or not ok:
        raise Unauthenticated("wrong email or password", field="password")
    return row


async def list_members(conn: psycopg.AsyncConnection[DictRow], tenant_id: str) -> list[dict]:
    cur = await conn.execute("SELECT id, email, role, created_at FROM members WHERE tenant_id = %s "
                             "AND removed_at IS NULL ORDER BY created_at", (tenant_id,))
    return await cur.fetchall()


async def remove(conn: psycopg.AsyncConnection[DictRow], tenant_id: str, member_id: str) -> dict:
    """Remove a member of this tenant (never its last owner) and revoke the keys they made; the
    caller ends their dashboard sessions."""
    row = await (await conn.execute(
        "UPDATE members SET removed_at = now() WHERE id = %s AND tenant_id = %s AND removed_at IS NULL "
        "RETURNING email, role", (member_id, tenant_id))).fetchone()
    if row is None:
        raise NotFound("no such member of your tenant", field="member_id")
    owners = db.one(await (await conn.execute("SELECT count(*) AS n FROM members WHERE tenant_id = %s "
                                              "AND role = 'owner' AND removed_at IS NULL", (tenant_id,))).fetchone())
    if row["role"] == "owner" and owners["n"] == 0:
        raise Conflict("a tenant keeps at least one owner; make someone else owner first", field="member_id")
    return {**row, "revoked_keys": await revoke_member_keys(conn, member_id)}


async def list_invitations(conn: psycopg.AsyncConnection[DictRow], tenant_id: str) -> list[dict]:
    """The tenant's invitations still open (unused, unexpired), oldest first."""
    cur = await conn.execute("SELECT id, email, role, created_by, expires_at FROM member_tokens WHERE tenant_id = %s "
                             "AND purpose = 'invite' AND used_at IS NULL AND expires_at > now() ORDER BY id",
                             (tenant_id,))
    return await cur.fetchall()


async def revoke_invitation(conn: psycopg.AsyncConnection[DictRow], tenant_id: str, invitation_id: int) -> dict:
    """Spend an open invitation of this tenant so its link stops working (NotFound otherwise)."""
    cur = await conn.execute("UPDATE member_tokens SET used_at = now() WHERE id = %s AND tenant_id = %s "
                             "AND purpose = 'invite' AND used_at IS NULL AND expires_at > now() RETURNING email",
                             (invitation_id, tenant_id))
    row = await cur.fetchone()
    if row is None:
        raise NotFound("no open invitation of your tenant with this id", field="invitation_id")
    return row


# ------------------------------------------------------------------------------- tokens and mail

async def new_token(conn: psycopg.AsyncConnection[DictRow], purpose: str, tenant_id: str, email: str, role: str | None,
                    created_by: str) -> str:
    token = secrets.token_urlsafe(32)
    ttl = INVITE_TTL_S if purpose == "invite" else RESET_TTL_S
    await conn.execute("INSERT INTO member_tokens (token_hash, purpose, tenant_id, email, role, created_by, expires_at) "
                       "VALUES (%s, %s, %s, %s, %s, %s, now() + make_interval(secs => %s))",
                       (_token_hash(token), purpose, tenant_id, email, role, created_by, ttl))
    return token


async def _use_token(conn: psycopg.AsyncConnection[DictRow], token: str, purpose: str) -> dict | None:
    """Mark a live token of this purpose used and return its row, or None (unknown, used or expired)."""
    cur = await conn.execute(
        "UPDATE member_tokens SET used_at = now() WHERE token_hash = %s AND purpose = %s AND used_at IS NULL "
        "AND expires_at > now() RETURNING tenant_id, email, role", (_token_hash(token), purpose))
    return await cur.fetchone()


async def start_reset(conn: psycopg.AsyncConnection[DictRow], email: str) -> str | None:
    """A reset token for a live account with this address, or None (the caller says the same either way)."""
    row = await (await conn.execute("SELECT tenant_id FROM members WHERE lower(email) = %s AND removed_at IS NULL",
                                    (email,))).fetchone()
    if row is None:
        return None
    return await new_token(conn, "reset", row["tenant_id"], email, None, "self")


async def finish_reset(conn: psycopg.AsyncConnection[DictRow], token: str, password_hash: str) -> list[str]:
    """Set the new password of the reset token's account (once), and spend the address's other
    reset links; returns the ids of the accounts whose sessions must end."""
    row = await _use_token(conn, token, "reset")
    if row is None:
        raise Forbidden("this reset link is unknown, used or expired; ask for a new one", field="token")
    await conn.execute("UPDATE member_tokens SET used_at = now() WHERE purpose = 'reset' AND lower(email) = %s "
                       "AND used_at IS NULL", (row["email"],))
    cur = await conn.execute("UPDATE members SET password_hash = %s WHERE lower(email) = %s AND removed_at IS NULL "
                             "RETURNING id", (password_hash, row["email"]))
    return [r["id"] for r in await cur.fetchall()]


def deliver(smtp_url: str, sender: str, to: str, subject: str, link: str) -> None:
    """Mail `link` to `to`, or without an SMTP server write it to the log for the operator to pass on."""
    if not smtp_url:
        log.warning("no mail server (QUILT_SMTP_URL): %s for %s: %s", subject, to, link)
        return
    url = urlsplit(smtp_url)
    message = EmailMessage()
    message["From"], message["To"], message["Subject"] = sender, to, subject
    message.set_content(f"{subject}:\n\n{link}\n")
    with smtplib.SMTP(url.hostname or "", url.port or 25, timeout=30) as smtp:  # (smtplib's default host is "")
        if url.username:
            smtp.starttls()
            smtp.login(url.username, url.password or "")
        smtp.send_message(message)
