"""The public status page (`/status`) and its JSON (`/api/v1/status`), and the operator's incident
notes shown on it.

Anyone may read the page, so it says only what a stranger may know: each component up or down,
the share of responses that were 5xx, each base's recent queue waits, and the operators' notes
(api.status_board picks every field by name). A flood of readers must not become a flood on the
stores: each API process assembles the status at most once every CACHE_S seconds (`StatusCache`;
readers arriving while it is being assembled wait for that one assembly), so N processes cost the
stores at most N assemblies per CACHE_S however many people reload the page.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from datetime import UTC, datetime
from typing import Literal

from fastapi import APIRouter, Request, Response
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from api import incidents, response_tally, status_board
from api.dashboard.render import PageRoute, page
from api.deps import Pool, RedisDep, Who
from api.input_guard import GuardedRoute
from bases import catalog
from core import db, health
from core.errors import Forbidden, InvalidInput
from core.settings import get_core_settings
from scaleout import in_service
from tenancy.auth import Principal

router = APIRouter(route_class=GuardedRoute, tags=["status"])
page_router = APIRouter(route_class=PageRoute, include_in_schema=False)
log = logging.getLogger("quilt.api")

CACHE_S = 2.0
# Readers may keep the answer as long as this process does; a shared proxy in front may too.
CACHE_CONTROL = f"public, max-age={int(CACHE_S)}"


class StatusCache:
    """This process's last assembled status, reused for CACHE_S seconds; one assembly at a time."""

    def __init__(self, ttl_s: float = CACHE_S, clock=time.monotonic):
        self.ttl_s, self.clock = ttl_s, clock
        self._doc: dict | None = None
        self._at = float("-inf")
        self._lock = asyncio.Lock()

    async def get(self, assemble) -> dict:
        if self.clock() - self._at < self.ttl_s and self._doc is not None:
            return self._doc
        async with self._lock:
            # Whoever waited on the lock finds the status the holder just assembled.
            if self.clock() - self._at >= self.ttl_s or self._doc is None:
                self._doc = await assemble()
                self._at = self.clock()
            return self._doc

    def drop(self) -> None:
        """An operator changed a note: this process shows it at once (others within CACHE_S)."""
        self._at = float("-inf")


async def _postgres_facts(pool) -> tuple[bool, list[catalog.BaseModel], list[dict] | None]:
    """Whether Postgres answers, the served bases and the notes (None: could not be read)."""
    try:
        async with pool.connection() as conn:
            await db.ping(conn)
            return True, await catalog.list_models(conn), await incidents.recent(conn)
    except Exception:  # the page reports an outage; it must not become one
        log.warning("status: postgres does not answer", exc_info=True)
        return False, [], None


def _beacon(raw) -> dict | None:
    return json.loads(raw) if raw else None


async def _workers(redis, bases: list[catalog.BaseModel]) -> list[status_board.WorkerFacts]:
    core = get_core_settings()
    keyed: list[tuple[status_board.WorkerKind, str, str, str, bool]] = []  # kind, name, base, key, in service
    for base in bases:
        record = await in_service.read_async(redis, base.name)
        if base.trainable:
            keys = health.trainer_keys(base.name, core.trainer_shards)
            serving = record.trainer_names(list(keys))
            keyed += [("trainer", name, base.name, key, name in serving) for name, key in keys.items()]
        if base.sampleable:
            keys = health.gen_keys(base.name, core.gen_replicas)
            serving = record.gen_names(list(keys))
            keyed += [("gen", name, base.name, key, name in serving) for name, key in keys.items()]
    raws = await redis.mget([k for _, _, _, k, _ in keyed]) if keyed else []
    return [status_board.WorkerFacts(kind, name, base, _beacon(raw), serving)
            for (kind, name, base, _, serving), raw in zip(keyed, raws, strict=True)]


async def assemble(pool, redis) -> dict:
    """The status as the page and the JSON show it (see the module docstring for what it leaves out)."""
    now = time.time()
    postgres_ok, bases, notes = await _postgres_facts(pool)
    redis_ok, workers, celery, counts = True, [], None, None
    try:
        await redis.ping()
        workers = await _workers(redis, bases)
        celery = _beacon(await redis.get(health.CELERY_KEY))
        counts = await response_tally.read(redis, now)
    except Exception:
        log.warning("status: redis does not answer", exc_info=True)
        redis_ok = False
        # Which workers exist is still known (the catalogue and the settings); whether they live is not.
        workers = [status_board.WorkerFacts(w.kind, w.name, w.base, None, True) for w in _configured(bases)]
    parts = status_board.components(postgres_ok=postgres_ok, redis_ok=redis_ok, workers=workers,
                                    celery_beacon=celery)
    return {
        "status": status_board.overall(parts),
        "at": datetime.fromtimestamp(now, UTC).isoformat(),
        "cached_for_s": CACHE_S,
        "components": [c.to_json() for c in parts],
        "errors": None if counts is None else [w.to_json() for w in status_board.error_windows(counts, now)],
        "queue_waits": [b.to_json() for b in status_board.queue_waits(workers)] if redis_ok else [],
        "incidents": notes,  # None while Postgres cannot be read
    }


def _configured(bases: list[catalog.BaseModel]) -> list[status_board.WorkerFacts]:
    core = get_core_settings()
    out = []
    for base in bases:
        if base.trainable:
            out += [status_board.WorkerFacts("trainer", n, base.name, None, True)
                    for n in health.trainer_keys(base.name, core.trainer_shards)]
        if base.sampleable:
            out += [status_board.WorkerFacts("gen", n, base.name, None, True)
                    for n in health.gen_keys(base.name, core.gen_replicas)]
    return out


async def _status(request: Request, pool, redis) -> dict:
    return await request.app.state.status_cache.get(lambda: assemble(pool, redis))


@router.get("/status")
async def get_status(request: Request, pool: Pool, redis: RedisDep, response: Response) -> dict:
    """The service's public status, no key needed: `status` (`ok`, `degraded` or `down`), each
    component's state (`up`, `down`, `leaving`: a worker a scaler is taking out of service, or
    `unknown` while Redis cannot be read), the responses and 5xx answered by every API process over
    the last 1, 5 and 15 minutes, each base's recent queue waits (p50 and p95 seconds from a
    request's arrival to its work starting), and the operators' incident notes. Assembled at most
    once every `cached_for_s` seconds per API process; always 200 (`/api/v1/healthz` is the probe)."""
    response.headers["Cache-Control"] = CACHE_CONTROL
    return await _status(request, pool, redis)


@page_router.get("/status")
async def status_page(request: Request, pool: Pool, redis: RedisDep) -> Response:
    """The status as a page for people (the same figures as `/api/v1/status`)."""
    doc = await _status(request, pool, redis)
    response = page(request, "status.html", {"s": doc})
    response.headers["Cache-Control"] = CACHE_CONTROL
    return response


class IncidentRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    title: str = Field(min_length=1, max_length=incidents.TITLE_MAX, description="one line, shown as written")
    body: str = Field("", max_length=incidents.BODY_MAX, description="what is affected and what to do; plain text")
    severity: Literal["minor", "major", "critical", "maintenance"]
    started_at: AwareDatetime | None = Field(None, description="when it began (with a time zone); absent: now")
    resolved_at: AwareDatetime | None = Field(None, description="when it ended; absent: still open")


class ResolveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    resolved_at: AwareDatetime | None = Field(None, description="when it ended (with a time zone); absent: now")


def _operator(who: Principal) -> None:
    if not who.is_operator:
        raise Forbidden("only an operator may post to the status page", field="X-API-Key")


@router.post("/status/incidents")
async def post_incident(body: IncidentRequest, who: Who, pool: Pool, request: Request) -> dict:
    """Post an incident note to the status page (operators only: an owner key of an operator
    tenant; anyone else gets a 403). Title at most 200 characters and not blank, body at most
    4,000, both plain text (the page escapes them); `resolved_at` not before `started_at`. The note
    is public: write nothing about a tenant in it. Shown by every API process within 2 s."""
    _operator(who)
    if not body.title.strip():
        raise InvalidInput("title: must not be blank", field="title")
    started_at = body.started_at or datetime.now(UTC)
    async with pool.connection() as conn:
        note = await incidents.post(conn, title=body.title, body=body.body, severity=body.severity,
                                    started_at=started_at, resolved_at=body.resolved_at, tenant_id=who.tenant_id,
                                    actor=who.actor)
        await conn.commit()
    request.app.state.status_cache.drop()
    return note


@router.post("/status/incidents/{incident_id}/resolve")
async def resolve_incident(incident_id: int, body: ResolveRequest, who: Who, pool: Pool, request: Request) -> dict:
    """Mark an incident note resolved (operators only), at `resolved_at` or now; resolving again
    moves the time. Resolved notes stay on the page for a week."""
    _operator(who)
    if not 0 < incident_id < 2**63:
        raise InvalidInput(f"incident_id: between 1 and {2**63 - 1}, got {incident_id}", field="incident_id")
    async with pool.connection() as conn:
        note = await incidents.resolve(conn, incident_id, body.resolved_at or datetime.now(UTC),
                                       tenant_id=who.tenant_id, actor=who.actor)
        await conn.commit()
    request.app.state.status_cache.drop()
    return note

