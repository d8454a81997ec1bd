"""Each API process's copy of the server's signing keys (core.signing_keys), shared by download
links (api.signed_urls) and SDK auth tokens (tenancy.tokens): re-read, and rotated when due, once
they are KEYS_REREAD_S old."""

from __future__ import annotations

from core import db
from core.settings import ApiSettings, get_security_settings
from core.signing_keys import SigningKeys, configured_keys, signing_keys
from tenancy import tokens


def rotation_s(settings: ApiSettings) -> int:
    """How often a new generation is made: never before whatever it signs has expired, so with the
    two newest valid, a link or token always outlives its key's turn."""
    return max(settings.download_key_rotation_s, settings.download_url_ttl_s, settings.auth_token_ttl_s)


async def server_keys(state, pool, settings: ApiSettings) -> SigningKeys:
    """The keys as the app's `state` holds them, read again when stale."""
    keys = getattr(state, "signing_keys", None)
    if keys is None or keys.stale:
        if settings.download_signing_key is not None:
            previous = settings.download_signing_key_previous
            keys = configured_keys(settings.download_signing_key.get_secret_value(),
                                   previous.get_secret_value() if previous else None)
        else:
            async with db.autocommit(pool) as conn:
                keys = await signing_keys(conn, rotation_s(settings),
                                          get_security_settings().secret_key.get_secret_value().encode())
        state.signing_keys = keys
        # Derived once per read, not per call: every token a process checks uses these.
        state.token_keys = keys.for_purpose(tokens.PURPOSE)
    return keys


async def token_keys(state, pool, settings: ApiSettings) -> SigningKeys:
    """The keys auth tokens are signed and checked with (each generation's, derived for tokens)."""
    await server_keys(state, pool, settings)
    return state.token_keys
