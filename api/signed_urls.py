"""Signed download URLs for checkpoint files: no API key in the URL, bound to the tenant, to one
checkpoint row and to the API key that asked for it, and expiring.

    <base>/api/v1/downloads/<token>/<file name>

The token is `generation.payload.signature`: the signing key's generation, then base64url of the
payload (the tenant, the checkpoint's row id, what to send: one file of the adapter, the whole
adapter as a .tar.gz, or the adapter merged into its base as a .tar; the expiry in unix seconds;
the id of the API key that minted it) and of its HMAC-SHA256. The file name at the end is only for
whoever saves the download; the token alone decides what is sent. A link stops working when it
expires, when its checkpoint is deleted or expires, when the key that minted it is revoked, when
an operator suspends its tenant (a payment suspension keeps downloads working), and when its
signing key is retired.

Signing keys rotate: a new generation is made (a random value in Postgres, server_secrets, shared
by every API replica, keyed with QUILT_SECRET_KEY so the database alone cannot sign) once the
newest is QUILT_DOWNLOAD_KEY_ROTATION_S old, and the two newest are valid, so a link (which lives
at most QUILT_DOWNLOAD_URL_TTL_S, never longer than a rotation) always outlives its key's turn.
`quilt downloads rotate-key --retire` makes a new one and retires every other: every link out
there stops working (within a minute, as API processes re-read the keys). With
QUILT_DOWNLOAD_SIGNING_KEY set, that key signs (and QUILT_DOWNLOAD_SIGNING_KEY_PREVIOUS, if set,
still verifies): rotation is then the operator's, by changing the two.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass, field

from core.errors import NotFound

ARCHIVE = ""  # `file` of a token for the whole adapter as a .tar.gz
MERGED = "*merged"  # `file` of a token for the adapter merged into its base, as a .tar
_SECRET_PREFIX = "download_signing_key:"
KEYS_REREAD_S = 60.0  # how long an API process keeps the keys it read before reading them again


@dataclass(frozen=True)
class Grant:
    """What one signed URL lets its holder fetch."""

    tenant_id: str
    checkpoint_id: int  # checkpoints.id
    file: str  # a file of the adapter, or ARCHIVE
    expires: int  # unix seconds
    api_key_id: str = ""  # the key that minted it ("" when a dashboard session did)


@dataclass(frozen=True)
class SigningKeys:
    """The keys links are checked against (generation -> key) and the one that signs new ones."""

    current: int
    keys: dict[int, bytes]
    read_at: float = field(default_factory=time.monotonic)

    @property
    def stale(self) -> bool:
        return time.monotonic() - self.read_at > KEYS_REREAD_S


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign(keys: SigningKeys, grant: Grant) -> str:
    payload = json.dumps([grant.tenant_id, grant.checkpoint_id, grant.file, grant.expires, grant.api_key_id],
                         separators=(",", ":")).encode()
    key = keys.keys[keys.current]
    return f"{keys.current}.{_b64(payload)}.{_b64(hmac.new(key, payload, hashlib.sha256).digest())}"


def verify(keys: SigningKeys, token: str, now: float | None = None) -> Grant:
    """The grant a token carries; NotFound (never more detail) when it is forged, altered,
    malformed or signed by a retired key, and a NotFound that says so when it has expired."""
    bad = NotFound("this download link is not valid; ask for a new one", field="token")
    generation, _, rest = token.partition(".")
    payload_b64, _, sig_b64 = rest.partition(".")
    if not generation.isdigit() or len(generation) > 18:
        raise bad
    key = keys.keys.get(int(generation))
    try:
        payload, sig = _unb64(payload_b64), _unb64(sig_b64)
    except (ValueError, TypeError):
        raise bad from None
    if key is None or not hmac.compare_digest(sig, hmac.new(key, payload, hashlib.sha256).digest()):
        raise bad
    tenant_id, checkpoint_id, file, expires, api_key_id = json.loads(payload)
    grant = Grant(str(tenant_id), int(checkpoint_id), str(file), int(expires), str(api_key_id))
    if grant.expires < (time.time() if now is None else now):
        raise NotFound("this download link has expired; ask for a new one", field="token")
    return grant


def configured_keys(current: str, previous: str | None) -> SigningKeys:
    """The operator's keys (QUILT_DOWNLOAD_SIGNING_KEY and its _PREVIOUS), each numbered by a hash
    of itself: a link keeps its key's number when that key moves to _PREVIOUS."""
    def number(key: str) -> int:
        return int.from_bytes(hashlib.sha256(b"quilt-download-key\x00" + key.encode()).digest()[:6], "big")

    keys = {number(k): k.encode() for k in (previous, current) if k}
    return SigningKeys(number(current), keys)


def derive(secret: bytes, stored: bytes) -> bytes:
    """A generation's signing key: its random value from Postgres keyed with QUILT_SECRET_KEY, so a
    copy of the database alone cannot sign a link."""
    return hmac.new(secret, b"quilt-download-key\x00" + stored, hashlib.sha256).digest()


async def signing_keys(conn, rotation_s: int, secret: bytes) -> SigningKeys:
    """The keys kept in Postgres: the two newest generations, after making a new one when the
    newest is `rotation_s` old (or there is none). Whichever process gets there first makes it."""
    rows = await _generations(conn)
    if not rows or rows[0]["age_s"] >= rotation_s:
        await _insert_generation(conn, (rows[0]["generation"] + 1) if rows else 1)
        rows = await _generations(conn)
    return SigningKeys(rows[0]["generation"], {r["generation"]: derive(secret, bytes(r["value"])) for r in rows[:2]})


async def rotate(conn, *, retire: bool) -> int:
    """Make a new signing key now; with `retire`, delete every other, so every link out there stops
    working. Returns the new generation."""
    rows = await _generations(conn)
    generation = (rows[0]["generation"] + 1) if rows else 1
    await _insert_generation(conn, generation)
    keep = 1 if retire else 2
    await conn.execute("DELETE FROM server_secrets WHERE name LIKE %s AND name <> ALL(%s)",
                       (_SECRET_PREFIX + "%", [_SECRET_PREFIX + str(g) for g in
                                               [generation, *[r["generation"] for r in rows]][:keep]]))
    return generation


async def _insert_generation(conn, generation: int) -> None:
    await conn.execute("INSERT INTO server_secrets (name, value) VALUES (%s, %s) ON CONFLICT (name) DO NOTHING",
                       (f"{_SECRET_PREFIX}{generation}", secrets.token_bytes(32)))


async def _generations(conn) -> list[dict]:
    cur = await conn.execute(
        "SELECT substr(name, %s)::bigint AS generation, value, extract(epoch FROM now() - created_at) AS age_s "
        "FROM server_secrets WHERE name LIKE %s ORDER BY 1 DESC", (len(_SECRET_PREFIX) + 1, _SECRET_PREFIX + "%"))
    return await cur.fetchall()
