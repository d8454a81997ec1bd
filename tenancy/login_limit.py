"""Brakes on guessing: failed dashboard logins counted in Redis, shared by every API replica.

Each failure (a wrong password for an address, a wrong API key) adds one to two counters in fixed
windows of QUILT_LOGIN_WINDOW_S: one per account (the email, hashed), one per client address.
Once either holds its limit (QUILT_LOGIN_FAILURES_PER_ACCOUNT, _PER_ADDRESS) further attempts are
refused with 429 and the seconds until the window ends, before any password is verified: a
guesser learns nothing and costs no Argon2 time. A successful login clears its account's counter.
Password-reset requests count against the same account and address, so the form cannot be used
to flood someone's inbox. The address is the connection's peer: behind a proxy, the proxy's
(configure the proxy to limit per client, or run uvicorn with --proxy-headers).
"""

from __future__ import annotations

import hashlib

from redis.asyncio import Redis

from core.errors import QuotaExceeded
from core.settings import get_api_settings


def _key(kind: str, value: str) -> str:
    return f"quilt:login:{kind}:" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def address_key(address: str) -> str:
    return _key("address", address)


def _keys(account: str | None, address: str) -> list[tuple[str, int, str]]:
    """(counter, its limit, whom it names) for the address and, given one, the account."""
    s = get_api_settings()
    out = [(address_key(address), s.login_failures_per_address, "this address")]
    if account:
        out.append((_key("account", account), s.login_failures_per_account, "this account"))
    return out


async def check(redis: Redis, *, account: str | None, address: str) -> None:
    """Raise 429 (QuotaExceeded, with Retry-After) while the account or the address is braked."""
    keys = _keys(account, address)
    pipe = redis.pipeline()
    for key, _, _ in keys:
        pipe.get(key)
        pipe.ttl(key)
    replies = await pipe.execute()
    for i, (_, limit, what) in enumerate(keys):
        count, ttl = int(replies[2 * i] or 0), int(replies[2 * i + 1])
        if count >= limit:
            wait = max(ttl, 1)
            raise QuotaExceeded(f"too many failed attempts from {what}; try again in {wait} s", field="login",
                                retry_after_s=float(wait))


# A window starts with its first failure (EXPIRE NX would say it, but the embedded Redis predates it).
_COUNT = """
for _, key in ipairs(KEYS) do
  if redis.call('INCR', key) == 1 then redis.call('EXPIRE', key, ARGV[1]) end
end
return 0
"""


async def failed(redis: Redis, *, account: str | None, address: str) -> None:
    """Count a failure (or a reset request) against the account and the address."""
    keys = [key for key, _, _ in _keys(account, address)]
    await redis.eval(_COUNT, len(keys), *keys, get_api_settings().login_window_s)


async def succeeded(redis: Redis, *, account: str) -> None:
    await redis.delete(_key("account", account))
