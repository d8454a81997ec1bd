"""Sessions: a client's lifetime, kept alive by heartbeats."""

from __future__ import annotations

from fastapi import APIRouter, Query, Response

from api import admission_rule, records
from api.deps import Pool, Who
from api.input_guard import GuardedRoute
from api.routes.runs import metadata_text
from api.schemas import (
    AssignProjectRequest,
    CreateSessionRequest,
    FinishSessionRequest,
    SessionHeartbeatRequest,
    SessionSearchRequest,
)
from core import db, ids
from core.errors import InvalidInput, UserError
from core.numbers import INT32_MAX
from core.settings import get_api_settings
from tenancy import scoped

router = APIRouter(route_class=GuardedRoute, tags=["sessions"])


class SessionFinished(UserError):
    status_code = 410


@router.post("/create_session")
async def create_session(body: CreateSessionRequest, who: Who, pool: Pool) -> dict:
    """Open a session, in `project_id` (the SDK's TINKER_PROJECT_ID; one of your tenant's projects,
    404 otherwise) or your default project; models and samplers are created inside one. Refused (402/403) while the
    tenant is suspended, and (429) while it holds QUILT_MAX_LIVE_SESSIONS_PER_TENANT live ones."""
    refusal = admission_rule.suspension_refusal(who)
    if refusal is not None:
        raise refusal
    session_id = ids.new_session_id()
    settings = get_api_settings()
    async with db.autocommit(pool) as conn:
        if body.project_id is not None:
            await scoped.get_project(conn, who, body.project_id)
        await records.insert_session(conn, who, session_id, tags=body.tags, user_metadata=body.user_metadata,
                                     sdk_version=body.sdk_version, display_name=body.display_name,
                                     max_live=settings.max_live_sessions_per_tenant, live_s=settings.session_live_s,
                                     project_id=body.project_id)
    return {"session_id": session_id, "type": "create_session"}


@router.post("/session_heartbeat")
async def session_heartbeat(body: SessionHeartbeatRequest, who: Who, pool: Pool) -> dict:
    """Keep a session alive; 410 once it has finished."""
    async with pool.connection() as conn:
        session = await scoped.get_session(conn, who, body.session_id)
        if session["finished_at"] is not None:
            raise SessionFinished(f"session {body.session_id!r} has finished", field="session_id")
        await records.touch_session(conn, body.session_id)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, body: FinishSessionRequest, who: Who, pool: Pool) -> dict:
    """Close a session (first reason wins)."""
    async with pool.connection() as conn:
        await scoped.get_session(conn, who, session_id)
        await records.finish_session(conn, session_id, str(body.reason.get("type", "success")))
    return {}


@router.get("/sessions")
async def list_sessions(who: Who, pool: Pool, limit: int = Query(20, ge=1, le=1000),
                        offset: int = Query(0, ge=0, le=INT32_MAX),
                        access_scope: str = Query("owned", max_length=32)) -> dict:
    """Session ids, newest first: those made by you (`owned`: your key, or another key of your
    member account) or every one of your tenant's (`accessible`)."""
    if access_scope not in scoped.ACCESS_SCOPES:
        raise InvalidInput(f"access_scope must be one of {list(scoped.ACCESS_SCOPES)}, got {access_scope!r}",
                           field="access_scope")
    async with pool.connection() as conn:
        return {"sessions": await scoped.list_sessions(conn, who, limit=limit, offset=offset, access_scope=access_scope)}


@router.post("/sessions/search")
async def search_sessions(body: SessionSearchRequest, who: Who, pool: Pool) -> dict:
    """Your tenant's sessions matching the SDK's SessionSearchRequest, newest first, one page of at
    most `limit` (1 to 200) and the cursor of the next (None after the last)."""
    async with pool.connection() as conn:
        for i, project in enumerate(body.project_ids or []):
            await scoped.get_project(conn, who, project, field=f"project_ids[{i}]")
        rows = await scoped.search_sessions(conn, who, _search(body))
    page = [_summary(r) for r in rows]
    last = rows[-1] if len(rows) == body.limit else None
    return {"sessions": page, "next_cursor": None if last is None else
            {"last_created_at": last["created_at"].isoformat(), "last_session_id": last["id"]}}


def _search(body: SessionSearchRequest) -> scoped.SessionSearch:
    prefixes = []
    for i, urn in enumerate(body.owner.owner_urns or []):
        kind, _, prefix = urn.partition(":")
        if kind != "key" or not prefix:
            raise InvalidInput(f"owner.owner_urns[{i}] must be key:<key prefix> (a session's owner is the key that "
                               f"made it), got {urn!r}", field=f"owner.owner_urns[{i}]")
        prefixes.append(prefix)
    statuses = None
    if body.statuses is not None:
        statuses = []
        for q in body.statuses:
            if q.type == "active":
                statuses.append("active")
            elif q.type == "client_finished":
                statuses += [f"client_finished:{r}" for r in (q.reasons or ("success", "errored", "interrupted"))]
            # cancelled and failed: Quilt has no console cancel and fails requests, not sessions; none match
    return scoped.SessionSearch(
        limit=body.limit, owner=body.owner.type, owner_prefixes=tuple(prefixes), session_id=body.session_id,
        display_words=tuple(body.display_name.split()) if body.display_name else (),
        project_ids=tuple(body.project_ids) if body.project_ids is not None else None,
        user_metadata=body.user_metadata, statuses=tuple(statuses) if statuses is not None else None,
        after=(body.cursor.last_created_at, body.cursor.last_session_id) if body.cursor else None)


def _summary(row: dict) -> dict:
    reason = row["finish_reason"]
    if row["finished_at"] is None:
        status: dict | None = {"type": "active"}
    elif reason in ("success", "errored", "interrupted"):
        status = {"type": "client_finished", "reason": {"type": reason}}
    else:
        status = None  # lapsed without a heartbeat: neither finished by its client nor running
    return {"session_id": row["id"], "created_at": row["created_at"].isoformat(),
            "owner": f"key:{row['key_prefix']}" if row["key_prefix"] else "unknown",
            "project_id": row["project_id"], "status": status, "checkpoints_count": row["checkpoints"],
            "display_name": row["display_name"], "user_metadata": metadata_text(row["user_metadata"]) or None,
            "checkpoint_storage_bytes": row["checkpoint_bytes"]}


@router.put("/sessions/{session_id}/project", status_code=204)
async def assign_session_project(session_id: str, body: AssignProjectRequest, who: Who, pool: Pool) -> Response:
    """Move one of your sessions (its training runs, samplers and checkpoints) into one of your
    projects; 404 for a session or project that is not your tenant's."""
    async with pool.connection() as conn:
        await scoped.get_session(conn, who, session_id)
        await scoped.get_project(conn, who, body.project_id)
        await records.assign_session_project(conn, who, session_id, body.project_id)
    return Response(status_code=204)


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, who: Who, pool: Pool, access_scope: str = Query("owned", max_length=32)) -> dict:
    """One of your sessions: its training runs, its samplers, and the `user_metadata` and
    `display_name` it was created with."""
    async with pool.connection() as conn:
        session, models, samplers = await scoped.session_contents(conn, who, session_id)
    return {"training_run_ids": models, "sampler_ids": samplers,
            "user_metadata": metadata_text(session["user_metadata"]) or None,
            "display_name": session["display_name"]}
