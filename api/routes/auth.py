"""The auth calls the tinker SDK and CLI make on their own credential:

    POST   auth/token        the API key in, a short-lived signed token out (tenancy.tokens);
                             only while QUILT_SDK_JWT_AUTH is on (the SDK asks for it then)
    GET    auth/apikey/me    the calling key, described (never its secret): `tinker auth login`
    DELETE auth/apikey/me    revoke the calling key: `tinker auth logout`

Every role may make them (tenancy.roles.SELF_CALLS): a token holds no more than its key, and a
key revoking itself only removes power.
"""

from __future__ import annotations

import hashlib
import logging

from fastapi import APIRouter, Request

from api import signing
from api.caller_cache import changing
from api.deps import Callers, Pool, Settings, Who
from api.input_guard import GuardedRoute
from core.errors import Forbidden, NotFound
from tenancy import accounts, keys, tokens
from tenancy.auth import Principal

router = APIRouter(route_class=GuardedRoute, prefix="/auth", tags=["auth"])
log = logging.getLogger("quilt.api")


@router.post("/token")
async def auth_token(request: Request, who: Who, pool: Pool, settings: Settings) -> dict:
    """Exchange the API key in X-API-Key for a signed token (`{"jwt": ...}`, HS256, lives
    QUILT_AUTH_TOKEN_TTL_S) standing for that key: its tenant, its role, its id. 404 while
    QUILT_SDK_JWT_AUTH is off; a token cannot be exchanged for another (403), so a leaked token
    dies with its expiry."""
    if not settings.sdk_jwt_auth:
        raise NotFound("auth tokens are off on this server (QUILT_SDK_JWT_AUTH); send the API key itself",
                       field="path")
    if getattr(request.state, "credential", "key") == "token":
        raise Forbidden("a token cannot mint tokens: exchange the API key itself", field="X-API-Key")
    token = tokens.mint(await signing.token_keys(request.app.state, pool, settings), who,
                        ttl_s=settings.auth_token_ttl_s)
    return {"jwt": token}


def _key_number(key_id: str) -> int:
    """The key's id as the number the tinker CLI types `key_id` as: its hex digits (key-<16 hex>),
    or for any other id a stable number from its hash."""
    digits = key_id.removeprefix("key-")
    try:
        return int(digits, 16)
    except ValueError:
        return int.from_bytes(hashlib.sha256(key_id.encode()).digest()[:8], "big")


def _described(who: Principal, info: keys.KeyInfo, email: str | None) -> dict:
    # The first four fields are the tinker CLI's SelfApiKeyResponse; the rest are Quilt's.
    return {"key_id": _key_number(info.id), "name": info.name, "note": info.prefix,
            "details": {"org_details": {"name": who.tenant_name}, "user_details": {"email": email or ""}},
            "id": info.id, "prefix": info.prefix, "role": info.role, "tenant_id": info.tenant_id,
            "created_at": info.created_at.isoformat()}


@router.get("/apikey/me")
async def get_own_key(who: Who, pool: Pool) -> dict:
    """The calling key (sent itself, or behind a token): its id, name, prefix, role, tenant and the
    email of the member who made it; never its secret."""
    async with pool.connection() as conn:
        info, email = await keys.own_key_async(conn, who.key_id, who.tenant_id)
    return _described(who, info, email)


@router.delete("/apikey/me")
async def revoke_own_key(who: Who, pool: Pool, callers: Callers) -> dict:
    """Revoke the calling key (sent itself, or behind a token, whose key it is) and nothing else;
    audit-logged as `key.revoked`. Every token it minted fails from the next call."""
    async with changing(pool, callers) as conn:
        revoked = await keys.revoke_own_key_async(conn, who.key_id, who.tenant_id)
        await accounts.record_async(conn, who.tenant_id, who.actor, "key.revoked", prefix=revoked.prefix,
                                    via="apikey/me")
    return {"revoked": True, "prefix": revoked.prefix}
