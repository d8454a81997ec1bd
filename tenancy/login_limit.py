"""Brakes on guessing and flooding: attempts counted in Redis, shared by every API replica.

Each brake is a set of counters in fixed windows of QUILT_LOGIN_WINDOW_S, taken atomically (one
Lua script) *before* the attempt is checked: when any counter would pass its limit the attempt is
refused with 429 and the seconds until that window ends, no password is verified, and nothing is
counted. So concurrent guesses cannot all slip past a limit, and a braked guesser costs no Argon2
time.

- `login`: per client address (QUILT_LOGIN_FAILURES_PER_ADDRESS) and per (account, address)
  (QUILT_LOGIN_FAILURES_PER_ACCOUNT). A stranger's wrong passwords brake the stranger's address and
  pair, never the owner logging in from elsewhere. A success gives its attempt back and clears
  its pair.
- `reset` (password-reset requests) and `signup` (sign-up and invitation acceptance): counters of
  their own, per address and per account (an inbox is not flooded, accounts are not minted in
  bulk), so they never count as failed logins and never lock anyone out of their account.
- `reset-link` (new passwords submitted with a reset link): per address and per link
  (`link_prefix` of its token, at the per-account limit), so neither one address trying many
  tokens nor many addresses trying one token guess far, and each guess costs no Argon2 time.
  Counted apart from logins: a guesser never locks the account's owner out.
- `invite` (invitations sent): per inviter and per address, each at the per-address limit, so a
  stolen owner session cannot mail-bomb strangers.

The address is the client's: the connection's peer, or the X-Forwarded-For of a proxy listed in
QUILT_TRUSTED_PROXIES (api.links). Behind an unlisted proxy every client shares the proxy's address.
"""

from __future__ import annotations

import hashlib
from typing import Literal

from redis.asyncio import Redis

from core.errors import QuotaExceeded
from core.settings import get_api_settings

Kind = Literal["login", "reset", "reset-link", "signup", "invite"]

# What a refusal says was too many, per kind.
_NOUNS = {"login": "failed attempts", "reset": "reset requests", "reset-link": "password resets",
          "signup": "sign-ups", "invite": "invitations"}
# How much of a reset token names its link for the brake. Reset tokens are 43 random characters,
# so this many never collide by chance; a guesser who varies only a tail is still counted once,
# and the key is bounded whatever length is sent.
LINK_PREFIX = 16


def _key(kind: str, *parts: str) -> str:
    digest = hashlib.sha256("\x00".join(parts).encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"quilt:brake:{kind}:{digest}"


def address_key(address: str) -> str:
    """The login counter of a client address (tests clear it)."""
    return _key("login-address", address)


def link_prefix(token: str) -> str:
    """Whom a reset-link attempt is counted against besides its address (the `account` of kind
    `reset-link`)."""
    return token.strip()[:LINK_PREFIX]


def _counters(kind: Kind, account: str | None, address: str) -> list[tuple[str, int, str]]:
    """(counter, its limit, whom it names, as the refusal says it)."""
    s = get_api_settings()
    if kind == "login":
        out = [(address_key(address), s.login_failures_per_address, "from this address")]
        if account:
            out.append((_key("login-pair", account, address), s.login_failures_per_account,
                        "from this account from this address"))
        return out
    out = [(_key(f"{kind}-address", address), s.login_failures_per_address, "from this address")]
    if account:
        # An owner onboarding a team sends more invitations than anyone asks for resets.
        per_account = s.login_failures_per_address if kind == "invite" else s.login_failures_per_account
        whom = "for this reset link" if kind == "reset-link" else "from this account"
        out.append((_key(f"{kind}-account", account), per_account, whom))
    return out


# Every counter is incremented (a window starts with its first count); if one passes its limit, all
# are given back and the longest wait among those past is returned (0: taken).
_TAKE = """
local wait = 0
for i, key in ipairs(KEYS) do
  local n = redis.call('INCR', key)
  if n == 1 then redis.call('EXPIRE', key, ARGV[1]) end
  if n > tonumber(ARGV[i + 1]) then
    local ttl = redis.call('TTL', key)
    if ttl < 1 then ttl = 1 end
    if ttl > wait then wait = ttl end
  end
end
if wait > 0 then
  for _, key in ipairs(KEYS) do redis.call('DECR', key) end
end
return wait
"""


async def take(redis: Redis, kind: Kind, *, account: str | None, address: str) -> None:
    """Count an attempt, or raise 429 (QuotaExceeded, with Retry-After) counting nothing when one of
    its brakes is full."""
    counters = _counters(kind, account, address)
    limits = [limit for _, limit, _ in counters]
    wait = int(await redis.eval(_TAKE, len(counters), *[key for key, _, _ in counters],
                                get_api_settings().login_window_s, *limits))
    if wait:
        whom = await _full(redis, counters)
        raise QuotaExceeded(f"too many {_NOUNS[kind]} {whom}; try again in {wait} s", field="login",
                            retry_after_s=float(wait))


async def _full(redis: Redis, counters: list[tuple[str, int, str]]) -> str:
    counts = await redis.mget([key for key, _, _ in counters])
    for (_, limit, whom), count in zip(counters, counts):
        if int(count or 0) >= limit:
            return whom
    return counters[0][2]


_GIVE_BACK = """
if redis.call('GET', KEYS[1]) and tonumber(redis.call('GET', KEYS[1])) > 0 then redis.call('DECR', KEYS[1]) end
if KEYS[2] then redis.call('DEL', KEYS[2]) end
return 0
"""


async def succeeded(redis: Redis, *, account: str | None, address: str) -> None:
    """A login that worked: its attempt is given back to the address and its pair is cleared."""
    keys = [key for key, _, _ in _counters("login", account, address)]
    await redis.eval(_GIVE_BACK, len(keys), *keys)
