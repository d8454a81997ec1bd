"""Projects, copies of weights and weights access tokens (issue 62 items 4 and 5; publishing
itself is a checkpoint route, api.routes.runs).

    GET  quilt/projects                          your tenant's projects (the default one first)
    POST quilt/projects {name}                   a new project
    POST copy_weights                            the tinker SDK's copy: a checkpoint into a project
                                                 (in a new session) or a session's model slot,
                                                 sharing the source's files (no byte copied)
    POST quilt/weights_access_tokens             a token to one of your checkpoints, for another
         {tinker_path, ttl_seconds?}             tenant's copy_weights (shown once)
    GET  quilt/weights_access_tokens             your tokens (never the secrets)
    DELETE quilt/weights_access_tokens/{id}      revoke one: copies with it stop at once

A copy may read the caller's own checkpoint, another tenant's published one, or one a live token
names (tenancy.sharing.copy_access); anything else is a 404, like a missing checkpoint. Making
and revoking a token, and each copy made with one, are in the owner's audit log.
"""

from __future__ import annotations

import hashlib

from fastapi import APIRouter, Header, Query, Response

from api import records
from api.deps import Pool, Who
from api.input_guard import GuardedRoute
from api.schemas import CopyWeightsRequest, CreateProjectRequest, WeightsTokenRequest
from core import db, ids
from core.errors import Conflict, Forbidden, InvalidInput, NotFound
from core.settings import get_tenancy_settings
from tenancy import accounts, scoped, sharing
from tenancy.auth import Principal

router = APIRouter(route_class=GuardedRoute, tags=["sharing"])

MAX_PROJECTS = 1000  # per tenant
MAX_TOKENS_LISTED = 500


def _project_json(row: dict) -> dict:
    return {"project_id": row["id"], "name": row["name"], "is_default": row["is_default"],
            "created_at": row["created_at"].isoformat(), **({"sessions": row["sessions"]} if "sessions" in row else {})}


@router.get("/quilt/projects")
async def list_projects(who: Who, pool: Pool) -> dict:
    """Your tenant's projects: the default one (where sessions without a project go) first."""
    async with pool.connection() as conn:
        return {"projects": [_project_json(r) for r in await scoped.list_projects(conn, who)]}


@router.post("/quilt/projects")
async def create_project(body: CreateProjectRequest, who: Who, pool: Pool) -> dict:
    """A new project of your tenant (409 if it has one of that name; at most MAX_PROJECTS)."""
    project_id = ids.new_project_id()
    async with db.autocommit(pool) as conn:
        if not await records.insert_project(conn, who, project_id, body.name, MAX_PROJECTS):
            raise Conflict(f"your tenant has a project named {body.name!r} already", field="name")
        await accounts.record_async(conn, who.tenant_id, who.actor, "project.created", project_id=project_id,
                                    name=body.name)
        return _project_json(await scoped.get_project(conn, who, project_id))


def _source(path: str) -> tuple[str, str, str]:
    try:
        run, kind, name = ids.parse_tinker_path(path)
    except ValueError as exc:
        raise InvalidInput(str(exc), field="source_path") from None
    if kind not in ("weights", "sampler_weights", "external_weights"):
        raise InvalidInput(f"source_path must name weights (tinker://<run>/weights|sampler_weights/<name>), got kind "
                           f"{kind!r}", field="source_path")
    return run, kind, name


def _copy_session_id(who: Principal, idempotency_key: str | None) -> str:
    """The new session of a copy into a project: derived from the SDK's X-Idempotency-Key when it
    sends one, so a retried copy finds the copy it made, not a second one."""
    if not idempotency_key:
        return ids.new_session_id()
    return "sess-" + hashlib.sha256(f"copy:{who.tenant_id}:{idempotency_key}".encode()).hexdigest()[:16]


@router.post("/copy_weights")
async def copy_weights(body: CopyWeightsRequest, who: Who, pool: Pool,
                       x_idempotency_key: str | None = Header(None, max_length=128),
                       x_tinker_weights_access_token: str | None = Header(None, max_length=256)) -> dict:
    """Copy a checkpoint (yours, a published one, or one a weights access token grants) into one of
    your projects (a new session holds it) or your session's model slot `model_seq_id`. The copy is
    a training run that takes no training call, holding one checkpoint of the source's kind and
    name, and the source's files (shared, not duplicated: deleting either leaves the other whole).
    It expires `ttl_seconds` from now, or never; the source's expiry is not inherited."""
    run, kind, name = _source(body.source_path)
    token = x_tinker_weights_access_token or body.weights_access_token
    async with db.autocommit(pool) as conn:
        if body.session_id is not None:
            session = await scoped.get_session(conn, who, body.session_id)
            if session["finished_at"] is not None:
                raise InvalidInput(f"session {body.session_id!r} has finished; copy into a live session or a project",
                                   field="session_id")
            session_id, seq = body.session_id, body.model_seq_id or 0
        else:
            assert body.destination_project_id is not None
            await scoped.get_project(conn, who, body.destination_project_id, field="destination_project_id")
            session_id, seq = _copy_session_id(who, x_idempotency_key), 0
        model_id = ids.training_model_id(session_id, seq)
        async with records.quota_lock(conn, who.tenant_id), conn.transaction():
            path = await _copy(conn, who, body, (run, kind, name), token, session_id, model_id, seq)
    return {"tinker_path": path}


async def _copy(conn, who: Principal, body: CopyWeightsRequest, source: tuple[str, str, str], token: str | None,
                session_id: str, model_id: str, seq: int) -> str:
    """The copy's tinker path, made in the caller's transaction (under the tenant's quota lock)."""
    run, kind, name = source
    missing = NotFound(f"checkpoint {body.source_path} not found", field="source_path")
    ckpt = await _locked_source(conn, run, kind, name)
    if ckpt is None:
        raise missing
    token_id = None
    if ckpt["tenant_id"] != who.tenant_id and ckpt["published_at"] is None and token:
        token_id = await records.use_weights_token(conn, sharing.token_hash(token), ckpt["id"], ckpt["storage_path"])
    access = sharing.copy_access(owner_tenant=ckpt["tenant_id"], caller_tenant=who.tenant_id,
                                 published=ckpt["published_at"] is not None, token_grants_it=token_id is not None)
    if access is None:
        raise missing
    copy_path = ids.tinker_path(model_id, kind, name)
    most = get_tenancy_settings().max_copies
    if await _already_copied(conn, who, model_id, body.source_path):
        return copy_path  # a retry of this copy: no cap applies to it
    refusal = sharing.cap_refusal(what="copies", held=await records.live_copies(conn, who.tenant_id), most=most,
                                  setting="QUILT_TENANT_MAX_COPIES")
    if refusal:
        raise Forbidden(refusal, field="max_copies")
    adds = 0 if await records.holds_files(conn, who.tenant_id, ckpt["storage_path"]) else ckpt["size_bytes"]
    refusal = sharing.copy_quota_refusal(stored_bytes=await scoped.checkpoint_bytes(conn, who), adds_bytes=adds,
                                         limit=who.max_checkpoint_bytes)
    if refusal:
        raise Forbidden(refusal, field="max_checkpoint_bytes")
    if body.destination_project_id is not None:
        await records.insert_copy_session(conn, who, session_id, body.destination_project_id)
    made = await records.insert_copy(conn, who, ckpt, model_id=model_id, session_id=session_id, model_seq_id=seq,
                                     copied_from=body.source_path, ttl_s=body.ttl_seconds)
    if not made:
        if not await _already_copied(conn, who, model_id, body.source_path):
            # 400, not 409: the SDK retries a 409 for minutes, and a taken slot stays taken.
            raise InvalidInput(f"model_seq_id {seq} of session {session_id!r} is taken; pick a free one",
                               field="model_seq_id")
        return copy_path  # a retry of this copy
    await accounts.record_async(conn, who.tenant_id, who.actor, "checkpoint.copied", source=body.source_path,
                                copy=copy_path, access=access)
    if token_id is not None:
        # In the owner's log, the copier named by tenant only (its key names are its own business).
        await accounts.record_async(conn, ckpt["tenant_id"], f"tenant:{who.tenant_id}", "checkpoint.token_used",
                                    token_id=token_id,
                                    tinker_path=body.source_path, by_tenant=who.tenant_id)
    return copy_path


async def _already_copied(conn, who: Principal, model_id: str, source_path: str) -> bool:
    """Whether run `model_id` of the caller's is a copy of `source_path` already (a retried copy)."""
    existing = await (await conn.execute("SELECT copied_from FROM training_models WHERE id = %s AND tenant_id = %s",
                                         (model_id, who.tenant_id))).fetchone()
    return existing is not None and existing["copied_from"] == source_path


async def _locked_source(conn, run: str, kind: str, name: str) -> dict | None:
    """The source checkpoint with its run's base, LoRA shape and optimizer, its row locked until
    the copy commits (checkpoints are deleted by row: a delete waits, then sees the copy)."""
    cur = await conn.execute("SELECT id FROM checkpoints WHERE model_id = %s AND kind = %s AND name = %s",
                             (run, kind, name))
    row = await cur.fetchone()
    if row is None or await records.lock_copy_source(conn, row["id"]) is None:
        return None
    cur = await conn.execute("SELECT c.*, m.base_model, m.lora_config, m.optimizer FROM checkpoints c "
                             "JOIN training_models m ON m.id = c.model_id WHERE c.id = %s", (row["id"],))
    return await cur.fetchone()


async def granted_checkpoint(conn, who: Principal, path: str, token: str) -> dict:
    """The training checkpoint `path` a weights access token lets the caller load into a model of its
    own (the SDK's `create_training_client_from_state(..., weights_access_token=)`, the cookbook's
    cross-account copy_checkpoint): the copy's grant (`sharing.copy_access`: yours, published, or the
    token's), with its run's base, LoRA shape and optimizer. A use by another tenant is written to the
    owner's audit log as a copy's is. One the caller may not read is a 404, like a missing one."""
    run, kind, name = ids.parse_tinker_path(path)
    async with conn.transaction():
        ckpt = await _locked_source(conn, run, kind, name)
        token_id = None
        if ckpt is not None and ckpt["tenant_id"] != who.tenant_id and ckpt["published_at"] is None:
            token_id = await records.use_weights_token(conn, sharing.token_hash(token), ckpt["id"], ckpt["storage_path"])
        if ckpt is None or sharing.copy_access(owner_tenant=ckpt["tenant_id"], caller_tenant=who.tenant_id,
                                               published=ckpt["published_at"] is not None,
                                               token_grants_it=token_id is not None) is None:
            raise NotFound(f"checkpoint {path} not found", field="path")
        if token_id is not None:
            await accounts.record_async(conn, ckpt["tenant_id"], f"tenant:{who.tenant_id}", "checkpoint.token_used",
                                        token_id=token_id, tinker_path=path, by_tenant=who.tenant_id)
    return ckpt


@router.post("/quilt/weights_access_tokens")
async def create_weights_token(body: WeightsTokenRequest, who: Who, pool: Pool) -> dict:
    """A token that lets whoever holds it copy one of your checkpoints (copy_weights'
    `weights_access_token`), until you revoke it or `ttl_seconds` pass. The token is shown once."""
    try:
        run, kind, name = ids.parse_tinker_path(body.tinker_path)
    except ValueError as exc:
        raise InvalidInput(str(exc), field="tinker_path") from None
    token, token_id = ids.new_weights_token(), ids.new_weights_token_id()
    async with db.autocommit(pool) as conn, records.quota_lock(conn, who.tenant_id), conn.transaction():
        ckpt = await scoped.get_checkpoint(conn, who, run, kind, name)
        most = get_tenancy_settings().max_weights_tokens
        refusal = sharing.cap_refusal(what="weights access tokens", held=await records.live_weights_tokens(conn, who.tenant_id),
                                      most=most, setting="QUILT_TENANT_MAX_WEIGHTS_TOKENS")
        if refusal:
            raise Forbidden(refusal, field="max_weights_tokens")
        row = await records.insert_weights_token(conn, who, token_id, ckpt, sharing.token_hash(token),
                                                 body.ttl_seconds)
        await accounts.record_async(conn, who.tenant_id, who.actor, "checkpoint.token_created", token_id=token_id,
                                    tinker_path=body.tinker_path)
    return {"id": token_id, "token": token, "tinker_path": body.tinker_path,
            "expires_at": row["expires_at"].isoformat() if row["expires_at"] else None}


@router.get("/quilt/weights_access_tokens")
async def list_weights_tokens(who: Who, pool: Pool, include_revoked: bool = Query(False)) -> dict:
    """Your tenant's weights access tokens, newest first (never their secrets)."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT w.id, w.created_by, w.created_at, w.expires_at, w.revoked_at, c.model_id, c.kind, c.name "
            "FROM weights_access_tokens w JOIN checkpoints c ON c.id = w.checkpoint_id WHERE w.tenant_id = %s "
            "AND (%s OR w.revoked_at IS NULL) ORDER BY w.created_at DESC LIMIT %s",
            (who.tenant_id, include_revoked, MAX_TOKENS_LISTED))
        rows = await cur.fetchall()
    return {"tokens": [{"id": r["id"], "tinker_path": ids.tinker_path(r["model_id"], r["kind"], r["name"]),
                        "created_by": r["created_by"], "created_at": r["created_at"].isoformat(),
                        "expires_at": r["expires_at"].isoformat() if r["expires_at"] else None,
                        "revoked_at": r["revoked_at"].isoformat() if r["revoked_at"] else None} for r in rows]}


@router.delete("/quilt/weights_access_tokens/{token_id}", status_code=204)
async def revoke_weights_token(token_id: str, who: Who, pool: Pool) -> Response:
    """Revoke a token of yours: no copy is made with it from now on (copies made already stay)."""
    async with pool.connection() as conn:
        row = await records.revoke_weights_token(conn, who, token_id)
        if row is None:
            raise NotFound(f"no live weights access token {token_id!r} of yours", field="token_id")
        await accounts.record_async(conn, who.tenant_id, who.actor, "checkpoint.token_revoked", token_id=token_id,
                                    tinker_path=ids.tinker_path(row["model_id"], row["kind"], row["name"]))
    return Response(status_code=204)
