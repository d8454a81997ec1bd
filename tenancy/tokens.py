"""Short-lived auth tokens the tinker SDK exchanges its API key for (`POST /api/v1/auth/token`,
when QUILT_SDK_JWT_AUTH is on), as standard JWTs: HS256 with the signing key's generation as `kid`,
so keys rotate with the server's other signing keys (core.signing_keys), each token key derived
for this use only.

Claims:

    iss, aud   "quilt"
    sub        quilt:apikey:<the minting key's id>   (the SDK's whoami shows it as the user URN)
    org_id     the key's tenant id                   (whoami: tml:organization:<org_id>)
    org_name   the tenant's name
    role       the key's role when minted (tenancy.roles)
    key_prefix the key's prefix, as key listings show it
    iat, exp   unix seconds; the SDK renews at half of exp - iat
    jti        random, to tell tokens apart in logs

A token is only a pointer to its key: on every use the key is looked up by id (api.deps, through
the callers' cache), so a revoked or deleted key, a tenant that no longer matches, or a role
lowered since minting take effect on the next call, and a token never carries more than its key
does now (its role claim can only lower the key's). Verification here is pure: a table of tokens
in, claims or `InvalidToken` out (tests/test_auth_tokens.py).
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass, replace

import jwt

from core.errors import InvalidToken
from core.signing_keys import SigningKeys
from tenancy import roles
from tenancy.auth import Principal

PURPOSE = b"sdk-auth-token"  # the derivation label of token keys (SigningKeys.for_purpose)
ISSUER = AUDIENCE = "quilt"
ALGORITHM = "HS256"
SUBJECT_PREFIX = "quilt:apikey:"
LEEWAY_S = 30  # clock skew between API replicas tolerated on iat and exp
# Every JWT starts with the base64 of '{"', and no Quilt key does ("tml-..."): the cheap test that
# sends a credential down the token path.
TOKEN_START = "eyJ"
# A Quilt token is about 500 characters; refusing far longer ones and anything but base64url and
# two dots before a parser sees them keeps hostile input (NUL, surrogates, megabytes) out of it.
MAX_TOKEN_CHARS = 4096
_SHAPE = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+")
_REQUIRED = ["iss", "aud", "sub", "org_id", "role", "iat", "exp", "jti"]


@dataclass(frozen=True)
class TokenClaims:
    """What a verified token says: the key it stands for and what that key was when minted."""

    key_id: str
    tenant_id: str
    role: str
    issued_at: int
    expires_at: int
    token_id: str
    generation: int = 0  # the signing key's (the header's kid)


def is_token(credential: str) -> bool:
    return credential.startswith(TOKEN_START)


def mint(keys: SigningKeys, who: Principal, *, ttl_s: int, now: float | None = None) -> str:
    """A token for the key behind `who` (never a dashboard session: it has no key to re-check)."""
    if not who.key_id:
        raise ValueError("only an API key's caller can be given a token")
    issued = int(time.time() if now is None else now)
    claims = {"iss": ISSUER, "aud": AUDIENCE, "sub": SUBJECT_PREFIX + who.key_id, "org_id": who.tenant_id,
              "org_name": who.tenant_name, "role": who.member_role, "key_prefix": who.key_prefix,
              "iat": issued, "exp": issued + ttl_s, "jti": secrets.token_urlsafe(12)}
    return jwt.encode(claims, keys.keys[keys.current], algorithm=ALGORITHM, headers={"kid": str(keys.current)})


def _invalid(why: str) -> InvalidToken:
    return InvalidToken(f"auth token {why}; exchange your API key for a new one (POST /api/v1/auth/token)",
                        field="X-API-Key")


def verify(keys: SigningKeys, token: str, now: float | None = None) -> TokenClaims:
    """The claims of a token this server minted and still honours, or InvalidToken saying why
    (never anything else, whatever `token` holds)."""
    if len(token) > MAX_TOKEN_CHARS or not _SHAPE.fullmatch(token):
        raise _invalid("is malformed")
    try:
        header = jwt.get_unverified_header(token)
    except jwt.PyJWTError:
        raise _invalid("is malformed") from None
    kid = header.get("kid")
    if not isinstance(kid, str) or not kid.isdigit() or len(kid) > 18:
        raise _invalid("names no signing key of this server")
    key = keys.keys.get(int(kid))
    if key is None:
        raise _invalid("was signed by a key this server has rotated out")
    try:
        # Only HS256 is accepted, whatever the header claims: `alg: none` and algorithm confusion
        # fail here. Times are checked below against `now`, so tables can pin the clock.
        claims = jwt.decode(token, key, algorithms=[ALGORITHM], audience=AUDIENCE, issuer=ISSUER,
                            options={"require": _REQUIRED, "verify_exp": False, "verify_iat": False,
                                     "verify_nbf": False})
    except jwt.PyJWTError:
        raise _invalid("has a bad signature or claims") from None
    return _checked(claims, int(kid), time.time() if now is None else now)


def _checked(claims: dict, generation: int, now: float) -> TokenClaims:
    sub, org_id, role, iat, exp, jti = (claims.get(k) for k in ("sub", "org_id", "role", "iat", "exp", "jti"))
    if not (isinstance(sub, str) and sub.startswith(SUBJECT_PREFIX) and isinstance(org_id, str)
            and role in roles.ROLES and isinstance(jti, str) and isinstance(iat, int) and isinstance(exp, int)
            and not isinstance(iat, bool) and not isinstance(exp, bool)):
        raise _invalid("has a bad signature or claims")
    if exp <= now - LEEWAY_S:
        raise _invalid("has expired")
    if iat > now + LEEWAY_S or exp <= iat:
        raise _invalid("is not valid yet")
    return TokenClaims(sub.removeprefix(SUBJECT_PREFIX), org_id, role, iat, exp, jti, generation)


class VerifiedTokens:
    """One process's memory of the tokens it has verified, so a token costs its signature check
    once (about 0.2 ms with PyJWT, a hundred times a key's hash) rather than on every call. A hit
    is still held to everything that can change after the check: the expiry against the clock,
    and the signing key, which must still be among `keys` (a retired generation ends its tokens
    here too). Bounded: past `max_entries` (about 1 KiB each) it starts over rather than grow;
    only a valid token is remembered, so only key holders can fill it, and a process sees about two
    live tokens per SDK client."""

    def __init__(self, max_entries: int = 10_000):
        self.max_entries = max_entries
        self._claims: dict[str, TokenClaims] = {}

    def verify(self, keys: SigningKeys, token: str, now: float | None = None) -> TokenClaims:
        now = time.time() if now is None else now
        claims = self._claims.get(token)
        if claims is None:
            claims = verify(keys, token, now)
            if len(self._claims) >= self.max_entries:
                self._claims.clear()
            self._claims[token] = claims
        elif claims.expires_at <= now - LEEWAY_S or claims.generation not in keys.keys:
            del self._claims[token]
            return verify(keys, token, now)  # raises, saying why
        return claims


def acting_as(who: Principal, claims: TokenClaims) -> Principal:
    """The caller a token acts as: its key as it is now (`who`, read by the token's key id), never
    above the role the token was minted with: a key lowered since keeps its lower role, one raised
    since does not lift the tokens it minted before."""
    if who.tenant_id != claims.tenant_id:  # only a forger could get here; refuse rather than trust either
        raise _invalid("does not match its key")
    return who if roles.at_most(who.member_role, claims.role) else replace(who, member_role=claims.role)
