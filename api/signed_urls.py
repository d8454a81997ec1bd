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

Signing keys are the server's rotating keys (core.signing_keys): a new generation once the newest
is QUILT_DOWNLOAD_KEY_ROTATION_S old, the two newest valid, so a link (which lives at most
QUILT_DOWNLOAD_URL_TTL_S, never longer than a rotation) always outlives its key's turn.
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
import time
from dataclasses import dataclass

from core.errors import NotFound

# The key machinery is shared with the SDK's auth tokens; these names are what callers of this
# module have always used.
from core.signing_keys import KEYS_REREAD_S, SigningKeys, configured_keys, derive, rotate, signing_keys  # noqa: F401

ARCHIVE = ""  # `file` of a token for the whole adapter as a .tar.gz
MERGED = "*merged"  # `file` of a token for the adapter merged into its base, as a .tar
TRACE = "*trace:"  # `file` of a token for a session's trace: this, then the session id (checkpoint_id 0)


@dataclass(frozen=True)
class Grant:
    """What one signed URL lets its holder fetch."""

    tenant_id: str
    checkpoint_id: int  # checkpoints.id
    file: str  # a file of the adapter, or ARCHIVE
    expires: int  # unix seconds
    api_key_id: str = ""  # the key that minted it ("" when a dashboard session did)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    """The bytes of canonical unpadded base64url; ValueError for anything else. The decoder alone
    ignores a last character's spare bits, so four spellings of one signature would all pass and
    a link altered in its last character would still work."""
    data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    if _b64(data) != text:
        raise ValueError("not canonical base64url")
    return data


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
