"""Typed dependencies: the pool, Redis, settings and the authenticated caller.

Every dependency is `async def`: FastAPI runs a plain function in its thread pool, a hop that
cost a cheap call about a seventh of its CPU (bench/api_load.py).
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from psycopg_pool import AsyncConnectionPool
from redis.asyncio import Redis

from api import caller_cache, signing
from api.caller_cache import CallerCache
from core import db
from core.db import AsyncConn
from core.errors import InvalidToken, Unauthenticated
from core.settings import ApiSettings, get_api_settings
from tenancy import tokens
from tenancy.auth import Principal, authenticate, missing_key, principal_for_key_id
from tenancy.keys import hash_key


async def _pool(request: Request) -> AsyncConnectionPool[AsyncConn]:
    return request.app.state.pool


async def _redis(request: Request) -> Redis:
    return request.app.state.redis


async def _callers(request: Request) -> CallerCache:
    return request.app.state.callers


async def _settings() -> ApiSettings:
    return get_api_settings()


Pool = Annotated[AsyncConnectionPool[AsyncConn], Depends(_pool)]
RedisDep = Annotated[Redis, Depends(_redis)]
Callers = Annotated[CallerCache, Depends(_callers)]
Settings = Annotated[ApiSettings, Depends(_settings)]


# Declared as security schemes, so the API's OpenAPI document says how to authenticate. Each reads
# its header as it comes, where a `Header()` parameter costs FastAPI a validation per call.
_KEY_HEADER = APIKeyHeader(name="X-API-Key", auto_error=False,
                           description="a Quilt API key, or an auth token minted from one by POST "
                                       "/api/v1/auth/token (the tinker SDK sends either here)")
_BEARER = HTTPBearer(auto_error=False, description="the same key as a bearer token (OpenAI clients)")


async def _principal(request: Request, x_api_key: Annotated[str | None, Security(_KEY_HEADER)],
                     bearer: Annotated[HTTPAuthorizationCredentials | None, Security(_BEARER)]) -> Principal:
    # The two security parameters declare the schemes in the OpenAPI document; the key itself is
    # read once, by `authenticate_request`, which every keyed route runs before its body is read
    # (api.input_guard.GuardedRoute).
    who = getattr(request.state, "who", None)
    return who if who is not None else await authenticate_request(request)


def key_of(request: Request) -> str | None:
    """The key: X-API-Key, else a bearer token (OpenAI clients, api.routes.openai_compat)."""
    key = request.headers.get("x-api-key")
    if key is None:
        scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            key = credentials.strip()
    return key


async def authenticate_request(request: Request) -> Principal:
    """The caller behind the request's key: a 401 for none or a wrong one, before any store is asked
    for a missing key. Sets `request.state.who`."""
    x_api_key = key_of(request)
    if not x_api_key:  # refused before a pooled connection is taken: an anonymous flood holds none
        raise missing_key()
    if tokens.is_token(x_api_key):
        return await _token_caller(request, x_api_key)
    # From the app's state, not as dependencies: each dependency costs a cheap call a solving pass.
    state = request.app.state
    pool, callers = state.pool, state.callers
    key_hash = hash_key(x_api_key).hex()
    who = callers.get("key", key_hash)
    if who is None:
        generation = callers.generation
        # A short-lived connection: routes that long-poll must not hold one while they wait. The key
        # and the spend in one statement: one round trip.
        async with db.autocommit(pool) as conn:
            who, spent = await authenticate(conn, x_api_key)
        callers.put(generation, "key", key_hash, who)
        callers.put(generation, "spend", who.tenant_id, spent)
    else:
        spent = await caller_cache.spend(callers, pool, who.tenant_id)
    return _settle(request, who, spent)


def _settle(request: Request, who: Principal, spent: int) -> Principal:
    request.state.tenant_id = who.tenant_id
    request.state.spend = (spent, time.monotonic())  # api.spend_header: reused if the answer comes soon
    request.state.who = who  # error handlers need the caller too (api.seq_gaps)
    return who


async def _token_caller(request: Request, token: str) -> Principal:
    """The caller behind an auth token (tenancy.tokens): its signature and times checked, then its
    key read by id on every use, so a revoked key's tokens fail from the next call. Every refusal
    is an InvalidToken, whose 401 makes the tinker SDK exchange its key for a new token once."""
    state = request.app.state
    pool, callers = state.pool, state.callers
    claims = state.verified_tokens.verify(await signing.token_keys(state, pool, get_api_settings()), token)
    who = callers.get("key_id", claims.key_id)
    if who is None:
        generation = callers.generation
        try:
            async with db.autocommit(pool) as conn:
                who = await principal_for_key_id(conn, claims.key_id)
        except Unauthenticated as exc:
            raise InvalidToken(f"the API key behind this auth token is no longer valid ({exc.message})",
                               field="X-API-Key") from None
        callers.put(generation, "key_id", claims.key_id, who)
    who = tokens.acting_as(who, claims)
    request.state.credential = "token"  # api.routes.auth: a token does not mint tokens
    return _settle(request, who, await caller_cache.spend(callers, pool, who.tenant_id))


def needs_key(dependant) -> bool:
    """Whether a route's dependencies (at any depth) include the API-key caller."""
    stack = [dependant]
    while stack:
        d = stack.pop()
        if d.call is _principal:
            return True
        stack.extend(d.dependencies)
    return False


Who = Annotated[Principal, Depends(_principal)]
