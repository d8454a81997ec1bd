"""The dashboard's pages: log in and out, a tenant's runs, checkpoints, samplers, spend and API
keys, and the operator's health page. Every read goes through the tenant-scoped queries, so another
tenant's run or checkpoint is a 404 page, exactly as in the API."""

from __future__ import annotations

from datetime import date
from typing import Annotated
from urllib.parse import urlencode

from fastapi import APIRouter, Form, Query, Request
from fastapi.responses import RedirectResponse, StreamingResponse

from api.caller_cache import changing
from api.dashboard import adapter_archive, sessions
from api.dashboard.deps import Changing, LoggedIn, OperatorOnly, Viewer, page_context
from api.dashboard.render import PageRoute, page
from api.deps import Callers, Pool, RedisDep
from api.errors import retry_after
from api.routes.billing import get_usage
from api.routes.downloads import adapter_download, merge_members
from bases import catalog
from checkpoints.layout import EXTERNAL_KIND, SAMPLER_KIND, TRAINING_KIND
from core.errors import Forbidden, NotFound, QuotaExceeded, Unauthenticated
from tenancy import accounts, keys, login_limit, roles, scoped
from tenancy.auth import authenticate

router = APIRouter(prefix="/dashboard", route_class=PageRoute, include_in_schema=False)

PAGE_SIZE = 50
CHECKPOINT_KINDS = (TRAINING_KIND, SAMPLER_KIND, EXTERNAL_KIND)
HOME = "/dashboard/runs"


def safe_next(target: str | None) -> str:
    """Where to go after logging in: only a dashboard path of this site (no open redirect)."""
    if target and target.startswith("/dashboard/") and not target.startswith("//") and "\\" not in target:
        return target
    return HOME


# ------------------------------------------------------------------------------ log in / out

def login_page(request: Request, next_path: str, *, error: str | None = None, status_code: int = 200,
               retry_after_s: float | None = None):
    token = sessions.new_csrf_token()
    response = page(request, "login.html", {"csrf_token": token, "next": next_path, "error": error},
                    status_code=status_code)
    sessions.set_cookie(response, request, sessions.LOGIN_CSRF_COOKIE, token)
    if retry_after_s is not None:
        response.headers["Retry-After"] = retry_after(retry_after_s)
    return response


def client_address(request: Request) -> str:
    """Whom failed logins are counted against (tenancy.login_limit): the connection's peer."""
    return request.client.host if request.client else "unknown"


async def braked_login(request: Request, redis, next_path: str, *, account: str | None, address: str):
    """Count a login attempt (tenancy.login_limit), or the login page answering 429 (with
    Retry-After) while this address or this account from it is braked; None when it may go on."""
    try:
        await login_limit.take(redis, "login", account=account, address=address)
    except QuotaExceeded as exc:
        return login_page(request, next_path, error=exc.message, status_code=429, retry_after_s=exc.retry_after_s)
    return None


@router.get("")
@router.get("/")
async def home() -> RedirectResponse:
    """The dashboard's front page is the runs list."""
    return RedirectResponse(HOME, status_code=303)


@router.get("/login")
async def login_form(request: Request, next: str = Query(HOME, max_length=2000)):
    """The login form: paste an API key."""
    return login_page(request, safe_next(next))


@router.post("/login")
async def login(request: Request, pool: Pool, redis: RedisDep,
                api_key: Annotated[str, Form(max_length=200)] = "",
                csrf_token: Annotated[str, Form(max_length=200)] = "",
                next: Annotated[str, Form(max_length=2000)] = HOME):
    """Check the API key and start a session (a fresh token every time: no session fixation)."""
    if not sessions.tokens_match(request.cookies.get(sessions.LOGIN_CSRF_COOKIE), csrf_token):
        raise Forbidden("missing or wrong CSRF token: reload the login page and try again", field="csrf_token")
    address = client_address(request)
    if braked := await braked_login(request, redis, safe_next(next), account=None, address=address):
        return braked
    async with pool.connection() as conn:
        try:
            who, _spent = await authenticate(conn, api_key.strip())
        except Unauthenticated as exc:  # the attempt stays counted
            return login_page(request, safe_next(next), error=exc.message, status_code=401)
    await login_limit.succeeded(redis, account=None, address=address)
    token, _ = await sessions.create(redis, who.key_id)
    response = RedirectResponse(safe_next(next), status_code=303)
    sessions.set_cookie(response, request, sessions.COOKIE, token)
    sessions.clear_cookie(response, request, sessions.LOGIN_CSRF_COOKIE)
    return response


@router.post("/logout")
async def logout(request: Request, viewer: Changing, redis: RedisDep) -> RedirectResponse:
    """End the session (server side: the cookie's token stops working even if it was copied)."""
    await sessions.end(redis, viewer.token)
    response = RedirectResponse("/dashboard/login", status_code=303)
    sessions.clear_cookie(response, request, sessions.COOKIE)
    return response


# ------------------------------------------------------------------------------ runs and checkpoints

def _run_state(model: dict, progress: dict) -> str:
    if model["status"] == "ready":
        if progress["waiting"]:  # calls held by the tenant's limits or a base at capacity (api.queue_states)
            return "waiting"
        return "training" if progress["in_flight"] else "idle"
    return model["status"]


@router.get("/runs")
async def runs(request: Request, viewer: LoggedIn, pool: Pool, offset: int = Query(0, ge=0, le=10**9)):
    """Your training runs, newest first, with state, step and latest loss."""
    async with pool.connection() as conn:
        models, total = await scoped.list_models(conn, viewer.who, limit=PAGE_SIZE, offset=offset)
        progress = await scoped.run_progress(conn, viewer.who, [m["id"] for m in models])
    rows = [{"model": m, "progress": progress[m["id"]], "state": _run_state(m, progress[m["id"]])} for m in models]
    return page(request, "runs.html", page_context(viewer, "runs", rows=rows, total=total, offset=offset,
                                                   page_size=PAGE_SIZE))


@router.get("/runs/{model_id}")
async def run_detail(request: Request, model_id: str, viewer: LoggedIn, pool: Pool):
    """One run: its curves (drawn from `/dashboard/data/runs/{id}`) and its checkpoints."""
    async with pool.connection() as conn:
        model = await scoped.get_model(conn, viewer.who, model_id)
        progress = (await scoped.run_progress(conn, viewer.who, [model_id]))[model_id]
        ckpts, _ = await scoped.list_checkpoints(conn, viewer.who, model_id=model_id)
    return page(request, "run.html", page_context(viewer, "runs", model=model, progress=progress,
                                          state=_run_state(model, progress), checkpoints=ckpts))


@router.get("/checkpoints")
async def checkpoints(request: Request, viewer: LoggedIn, pool: Pool, offset: int = Query(0, ge=0, le=10**9)):
    """All your checkpoints, newest first, each with a download of its adapter."""
    async with pool.connection() as conn:
        ckpts, total = await scoped.list_checkpoints(conn, viewer.who, limit=PAGE_SIZE, offset=offset)
    return page(request, "checkpoints.html", page_context(viewer, "checkpoints", checkpoints=ckpts, total=total,
                                                  offset=offset, page_size=PAGE_SIZE))


async def _own_checkpoint(viewer: Viewer, pool, model_id: str, kind: str, name: str) -> dict:
    if kind not in CHECKPOINT_KINDS:
        raise NotFound(f"no checkpoint kind {kind!r}; kinds are {list(CHECKPOINT_KINDS)}", field="kind")
    async with pool.connection() as conn:
        return await scoped.get_checkpoint(conn, viewer.who, model_id, kind, name)


@router.get("/runs/{model_id}/checkpoints/{kind}/{name}/adapter.tar.gz")
async def download_adapter(model_id: str, kind: str, name: str, viewer: LoggedIn, pool: Pool) -> StreamingResponse:
    """The checkpoint's PEFT adapter (adapter_config.json, adapter_model.safetensors) as a .tar.gz."""
    ckpt = await _own_checkpoint(viewer, pool, model_id, kind, name)
    return await adapter_download(ckpt)


@router.get("/runs/{model_id}/checkpoints/{kind}/{name}/merged.tar")
async def download_merged(model_id: str, kind: str, name: str, viewer: LoggedIn, pool: Pool) -> StreamingResponse:
    """The checkpoint's adapter merged into its base: a Hugging Face model directory, as a .tar."""
    ckpt = await _own_checkpoint(viewer, pool, model_id, kind, name)
    return adapter_archive.merged_response(model_id, name, await merge_members(pool, ckpt))


@router.get("/samplers")
async def samplers(request: Request, viewer: LoggedIn, pool: Pool):
    """Your samplers (sampling sessions) and how many requests each has run."""
    async with pool.connection() as conn:
        rows = await scoped.list_sampling_sessions(conn, viewer.who)
    return page(request, "samplers.html", page_context(viewer, "samplers", samplers=rows))


# ------------------------------------------------------------------------------ spend and keys

@router.get("/spend")
async def spend(request: Request, viewer: LoggedIn, pool: Pool, since: date | None = None, until: date | None = None):
    """Spend by day and by model (plots) and this month's budgets; the same numbers as
    `GET /api/v1/quilt/usage`, which this page calls in-process."""
    usage = await get_usage(viewer.who, pool, since, until)
    return page(request, "spend.html", page_context(viewer, "spend", usage=usage))


async def _keys_page(request: Request, viewer: Viewer, pool, **extra):
    async with pool.connection() as conn:
        rows = await keys.list_keys_async(conn, viewer.who.tenant_id)
    key_roles = [r for r in roles.ROLES if roles.at_most(r, viewer.who.member_role)]
    return page(request, "keys.html", page_context(viewer, "keys", keys=rows, key_roles=key_roles, **extra))


@router.get("/keys")
async def keys_page(request: Request, viewer: LoggedIn, pool: Pool, revoked: str | None = Query(None, max_length=40)):
    """Your API keys (prefixes only; secrets are never stored)."""
    return await _keys_page(request, viewer, pool, revoked=revoked)


@router.post("/keys")
async def create_key(request: Request, viewer: Changing, pool: Pool,
                     name: Annotated[str, Form(max_length=100)] = "",
                     role: Annotated[str, Form(max_length=20)] = ""):
    """Create a key holding at most the viewer's role (by default, that role); its secret is in this
    response only (not in a redirect URL, not in the session). It answers to the viewer's account:
    removing them revokes it."""
    who = viewer.who
    key_role = roles.key_role(role or who.member_role, who.member_role)
    async with pool.connection() as conn:
        secret, info = await keys.create_key_async(conn, who.tenant_id, name.strip(), role=key_role,
                                                   member_id=who.member_id, created_by=who.actor)
        await accounts.record_async(conn, who.tenant_id, who.actor, "key.created", prefix=info.prefix, name=info.name,
                                    role=key_role)
    return await _keys_page(request, viewer, pool, new_secret=secret, new_key=info)


@router.post("/keys/revoke")
async def revoke_key(viewer: Changing, pool: Pool, callers: Callers, prefix: Annotated[str, Form(max_length=40)] = ""):
    """Revoke a key by prefix: owners any of the tenant's, others those their account made.
    Revoking the key this session logged in with ends it."""
    who = viewer.who
    async with changing(pool, callers) as conn:
        key = await keys.key_by_prefix_async(conn, prefix, who.tenant_id)
        if not roles.may_revoke(who.member_role, who.member_id, key.member_id):
            raise Forbidden("only an owner may revoke a key someone else made", field="prefix")
        revoked = await keys.revoke_key_async(conn, prefix, who.tenant_id)
        await accounts.record_async(conn, who.tenant_id, who.actor, "key.revoked", prefix=revoked.prefix)
    return RedirectResponse("/dashboard/keys?" + urlencode({"revoked": prefix}), status_code=303)


# ------------------------------------------------------------------------------ operator

@router.get("/ops")
async def ops(request: Request, viewer: OperatorOnly, pool: Pool):
    """Queue and pool health, refreshed live from `/dashboard/data/ops` (operators only)."""
    async with pool.connection() as conn:
        bases = await catalog.list_models(conn)
    return page(request, "ops.html", page_context(viewer, "ops", bases=bases))
