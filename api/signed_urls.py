"""Signed download URLs for checkpoint files: no API key in the URL, bound to the tenant and to one
checkpoint row, and expiring.

    <base>/api/v1/downloads/<token>/<file name>

The token is `payload.signature`, both base64url: the payload names the tenant, the checkpoint's
row id, what to send (one file of the adapter, the whole adapter as a .tar.gz, or the adapter
merged into its base as a .tar) and the expiry
(unix seconds); the signature is HMAC-SHA256 over the payload. The file name at the end is only for
whoever saves the download; the token alone decides what is sent. A deleted or expired checkpoint
(its row gone or no longer live) answers 404 even while its URLs are unexpired.

The key is QUILT_DOWNLOAD_SIGNING_KEY, or else one made at random once and kept in Postgres
(server_secrets), so every API replica signs and checks with the same key.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass

from core.errors import NotFound

ARCHIVE = ""  # `file` of a token for the whole adapter as a .tar.gz
MERGED = "*merged"  # `file` of a token for the adapter merged into its base, as a .tar
_SECRET_NAME = "download_signing_key"


@dataclass(frozen=True)
class Grant:
    """What one signed URL lets its holder fetch."""

    tenant_id: str
    checkpoint_id: int  # checkpoints.id
    file: str  # a file of the adapter, or ARCHIVE
    expires: int  # unix seconds


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign(key: bytes, grant: Grant) -> str:
    payload = json.dumps([grant.tenant_id, grant.checkpoint_id, grant.file, grant.expires],
                         separators=(",", ":")).encode()
    return f"{_b64(payload)}.{_b64(hmac.new(key, payload, hashlib.sha256).digest())}"


def verify(key: bytes, token: str, now: float | None = None) -> Grant:
    """The grant a token carries; NotFound (never more detail) when it is forged, altered or
    malformed, and a NotFound that says so when it has expired."""
    bad = NotFound("this download link is not valid; ask for a new one", field="token")
    payload_b64, _, sig_b64 = token.partition(".")
    try:
        payload, sig = _unb64(payload_b64), _unb64(sig_b64)
    except (ValueError, TypeError):
        raise bad from None
    if not hmac.compare_digest(sig, hmac.new(key, payload, hashlib.sha256).digest()):
        raise bad
    tenant_id, checkpoint_id, file, expires = json.loads(payload)
    grant = Grant(str(tenant_id), int(checkpoint_id), str(file), int(expires))
    if grant.expires < (time.time() if now is None else now):
        raise NotFound("this download link has expired; ask for a new one", field="token")
    return grant


async def signing_key(conn, configured: str | None) -> bytes:
    """The configured key, or the one kept in Postgres (made by whichever process asks first)."""
    if configured:
        return configured.encode()
    await conn.execute("INSERT INTO server_secrets (name, value) VALUES (%s, %s) ON CONFLICT (name) DO NOTHING",
                       (_SECRET_NAME, secrets.token_bytes(32)))
    cur = await conn.execute("SELECT value FROM server_secrets WHERE name = %s", (_SECRET_NAME,))
    return bytes((await cur.fetchone())["value"])
