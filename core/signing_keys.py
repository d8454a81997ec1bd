"""The server's rotating signing keys: one mechanism for everything the API signs (download links,
api.signed_urls; SDK auth tokens, tenancy.tokens).

A generation is a random value in Postgres (server_secrets, shared by every API replica), keyed
with QUILT_SECRET_KEY so a copy of the database alone cannot sign anything. A new generation is
made once the newest is the rotation period old, and the two newest verify, so whatever was signed
with the previous one keeps working for at least one more period. `rotate(retire=True)` (`quilt
downloads rotate-key --retire`) makes a new one and deletes every other: everything signed before
stops verifying, within KEYS_REREAD_S as API processes re-read the keys. With an operator's key
configured (QUILT_DOWNLOAD_SIGNING_KEY and its _PREVIOUS) those sign instead, and rotation is the
operator's.

Each use signs with a key of its own derived from the generation (`for_purpose`), so a download
link's MAC can never be passed off as a token's, or the other way round. Download links keep the
generation's key itself, so links signed before purposes existed still verify.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from core.db import AsyncConn

_SECRET_PREFIX = "download_signing_key:"  # the rows' names predate the tokens; renaming would retire every link
KEYS_REREAD_S = 60.0  # how long an API process keeps the keys it read before reading them again


@dataclass(frozen=True)
class SigningKeys:
    """The keys signatures are checked against (generation -> key) and the one that signs new ones."""

    current: int
    keys: dict[int, bytes]
    read_at: float = field(default_factory=time.monotonic)

    @property
    def stale(self) -> bool:
        return time.monotonic() - self.read_at > KEYS_REREAD_S

    def for_purpose(self, purpose: bytes) -> SigningKeys:
        """The same generations, each key derived for one use only (domain separation)."""
        return SigningKeys(self.current, {g: hmac.new(k, b"quilt-purpose\x00" + purpose, hashlib.sha256).digest()
                                          for g, k in self.keys.items()}, self.read_at)


def configured_keys(current: str, previous: str | None) -> SigningKeys:
    """The operator's keys (QUILT_DOWNLOAD_SIGNING_KEY and its _PREVIOUS), each numbered by a hash
    of itself: a signature keeps its key's number when that key moves to _PREVIOUS."""
    def number(key: str) -> int:
        return int.from_bytes(hashlib.sha256(b"quilt-download-key\x00" + key.encode()).digest()[:6], "big")

    keys = {number(k): k.encode() for k in (previous, current) if k}
    return SigningKeys(number(current), keys)


def derive(secret: bytes, stored: bytes) -> bytes:
    """A generation's signing key: its random value from Postgres keyed with QUILT_SECRET_KEY, so a
    copy of the database alone cannot sign."""
    return hmac.new(secret, b"quilt-download-key\x00" + stored, hashlib.sha256).digest()


async def signing_keys(conn: AsyncConn, rotation_s: int, secret: bytes) -> SigningKeys:
    """The keys kept in Postgres: the two newest generations, after making a new one when the
    newest is `rotation_s` old (or there is none). Whichever process gets there first makes it."""
    rows = await _generations(conn)
    if not rows or rows[0]["age_s"] >= rotation_s:
        await _insert_generation(conn, (rows[0]["generation"] + 1) if rows else 1)
        rows = await _generations(conn)
    return SigningKeys(rows[0]["generation"], {r["generation"]: derive(secret, bytes(r["value"])) for r in rows[:2]})


async def rotate(conn: AsyncConn, *, retire: bool) -> int:
    """Make a new signing key now; with `retire`, delete every other, so everything signed before
    stops verifying. Returns the new generation."""
    rows = await _generations(conn)
    generation = (rows[0]["generation"] + 1) if rows else 1
    await _insert_generation(conn, generation)
    keep = 1 if retire else 2
    await conn.execute("DELETE FROM server_secrets WHERE name LIKE %s AND name <> ALL(%s)",
                       (_SECRET_PREFIX + "%", [_SECRET_PREFIX + str(g) for g in
                                               [generation, *[r["generation"] for r in rows]][:keep]]))
    return generation


async def _insert_generation(conn: AsyncConn, generation: int) -> None:
    await conn.execute("INSERT INTO server_secrets (name, value) VALUES (%s, %s) ON CONFLICT (name) DO NOTHING",
                       (f"{_SECRET_PREFIX}{generation}", secrets.token_bytes(32)))


async def _generations(conn: AsyncConn) -> list[dict[str, Any]]:
    cur = await conn.execute(
        "SELECT substr(name, %s)::bigint AS generation, value, extract(epoch FROM now() - created_at) AS age_s "
        "FROM server_secrets WHERE name LIKE %s ORDER BY 1 DESC", (len(_SECRET_PREFIX) + 1, _SECRET_PREFIX + "%"))
    return await cur.fetchall()
