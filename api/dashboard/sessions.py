"""Dashboard sessions: a random token in a cookie, the session itself in Redis.

Logging in with an API key creates a session that remembers the *id* of that key, never the key;
every request re-reads the key and its tenant (`tenancy.auth.principal_for_key_id`), so revoking the
key or changing the tenant's role takes effect at once. A member's password login remembers the
member's id the same way (`principal_for_account`): removing the member ends their sessions. Redis holds
the session under a hash of the token, so a copy of Redis does not hand out sessions.

CSRF: each session carries its own random token; every state-changing request must send it back
(form field `csrf_token` or header `X-CSRF-Token`), compared in constant time. The login form,
which has no session yet, uses a double-submit cookie instead.

Cookies: HttpOnly (scripts never see the token), SameSite=Lax (not sent on cross-site POSTs),
Secure when QUILT_PUBLIC_URL is https or the request came over HTTPS (directly or through a proxy in
QUILT_TRUSTED_PROXIES: api.links), and scoped to `/dashboard` so API calls never carry them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from dataclasses import asdict, dataclass

from fastapi import Request, Response
from redis.asyncio import Redis

from api import links

COOKIE = "quilt_session"
LOGIN_CSRF_COOKIE = "quilt_login_csrf"
COOKIE_PATH = "/dashboard"
IDLE_TTL_S = 8 * 3600  # a session unused this long ends
MAX_AGE_S = 7 * 24 * 3600  # and none lives longer than this, used or not


@dataclass(frozen=True)
class DashSession:
    key_id: str  # "" for a member account's session
    csrf_token: str
    created_at: float
    account_id: str | None = None  # a member account (tenancy.members), when logged in with a password


def _redis_key(token: str) -> str:
    return "quilt:dash:session:" + hashlib.sha256(token.encode()).hexdigest()


async def create(redis: Redis, key_id: str = "", *, account_id: str | None = None) -> tuple[str, DashSession]:
    """A new session for the key with this id, or for a member account; returns (the cookie token,
    the session)."""
    token = secrets.token_urlsafe(32)
    session = DashSession(key_id=key_id, csrf_token=secrets.token_urlsafe(32), created_at=time.time(),
                          account_id=account_id)
    await redis.set(_redis_key(token), json.dumps(asdict(session)), ex=IDLE_TTL_S)
    return token, session


async def load(redis: Redis, token: str | None) -> DashSession | None:
    """The live session for a cookie token (its idle timer restarts), or None."""
    if not token:
        return None
    key = _redis_key(token)
    raw = await redis.get(key)
    if raw is None:
        return None
    session = DashSession(**json.loads(raw))
    ended = await redis.get(_ended_key(session.account_id)) if session.account_id else None
    if time.time() - session.created_at > MAX_AGE_S or (ended is not None and session.created_at <= float(ended)):
        await redis.delete(key)
        return None
    await redis.expire(key, IDLE_TTL_S)
    return session


def _ended_key(account_id: str) -> str:
    return "quilt:dash:account-sessions-ended:" + account_id


async def end_account(redis: Redis, account_id: str) -> None:
    """End every session of a member account begun until now (after a password reset)."""
    await redis.set(_ended_key(account_id), repr(time.time()), ex=MAX_AGE_S)


async def end(redis: Redis, token: str | None) -> None:
    if token:
        await redis.delete(_redis_key(token))


def tokens_match(expected: str | None, given: str | None) -> bool:
    """Constant-time comparison; a missing token never matches."""
    if not expected or not given:
        return False
    # Bytes: compare_digest refuses str with non-ASCII characters (a TypeError, not a mismatch).
    return hmac.compare_digest(str(expected).encode("utf-8", "surrogatepass"), str(given).encode("utf-8", "surrogatepass"))


def new_csrf_token() -> str:
    return secrets.token_urlsafe(32)


def set_cookie(response: Response, request: Request, name: str, value: str) -> None:
    response.set_cookie(name, value, path=COOKIE_PATH, httponly=True, samesite="lax", secure=links.secure(request))


def clear_cookie(response: Response, request: Request, name: str) -> None:
    response.delete_cookie(name, path=COOKIE_PATH, httponly=True, samesite="lax", secure=links.secure(request))
