"""Service-level routes: health, capabilities, the SDK handshake."""

from __future__ import annotations

import json
import logging

from fastapi import APIRouter, Request, Response

from api.deps import Pool, RedisDep, Settings, Who, authenticate_request, key_of
from api.input_guard import GuardedRoute
from bases import catalog
from core import db, health
from core.settings import get_core_settings
from scaleout import in_service

router = APIRouter(route_class=GuardedRoute, tags=["service"])
log = logging.getLogger("quilt.api")


def _aggregates(raw: str | bytes | None, keyed: bool) -> dict:
    # Anonymous: up or down only. With a key: a beacon's pool-wide scalar counters too
    # (examples/rl_multitenant.py reads them); per-tenant breakdowns (dicts and lists keyed by
    # tenant) are for the operator page.
    if not keyed:
        return {}
    beacon = json.loads(raw) if raw else {}
    return {k: v for k, v in beacon.items() if not isinstance(v, (dict, list))}


@router.get("/livez")
async def livez() -> dict:
    """This API process answers (a container's liveness probe): nothing else is checked, so a store
    outage never gets healthy API processes restarted."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(pool: Pool, redis: RedisDep, response: Response) -> dict:
    """This API process can serve requests: Postgres and Redis answer (a container's readiness
    probe). Workers are not checked: requests for a base whose trainer is down still queue."""
    checks = {"postgres": (await _postgres(pool, with_bases=False))[0], "redis": await _redis(redis)}
    ready = all(c["ok"] for c in checks.values())
    if not ready:
        response.status_code = 503
    return {"status": "ready" if ready else "unavailable", "checks": checks}


async def _postgres(pool, *, with_bases: bool = True) -> tuple[dict, list[catalog.BaseModel]]:
    """Postgres's health, and (`with_bases`) the served bases read on the way (health must report,
    not raise)."""
    try:
        async with pool.connection() as conn:
            await db.ping(conn)
            return {"ok": True}, await catalog.list_models(conn) if with_bases else []
    except Exception:
        log.warning("health: postgres does not answer", exc_info=True)
        return {"ok": False}, []


async def _redis(redis) -> dict:
    try:
        await redis.ping()
        return {"ok": True}
    except Exception:
        log.warning("health: redis does not answer", exc_info=True)
        return {"ok": False}


async def _workers(redis, components: dict, kind: str, keys: dict[str, str], serving: list[str], keyed: bool) -> None:
    """A component per worker in service (down when its beacon lapsed); one a scaler took out of
    service shows only while it still beats, as leaving, not down."""
    for name, key in keys.items():
        raw = await redis.get(key)
        if name in serving:
            components[f"{kind}:{name}"] = {"ok": raw is not None, **_aggregates(raw, keyed)}
        elif raw is not None:
            components[f"{kind}:{name}"] = {"ok": True, "leaving": True, **_aggregates(raw, keyed)}


@router.get("/healthz")
async def healthz(request: Request, pool: Pool, redis: RedisDep, response: Response) -> dict:
    """Each component up or down: postgres, redis, each trainer shard and generation replica per
    base model, celery; 503 when one is down. No key needed, and then that is all it says (no
    store error text, no figures); with a valid key, also the workers' pool-wide scalar counters
    (a wrong key is a 401)."""
    keyed = bool(key_of(request))
    if keyed:
        await authenticate_request(request)
    components: dict[str, dict] = {}
    components["postgres"], bases = await _postgres(pool)
    components["redis"] = await _redis(redis)
    if components["redis"]["ok"]:
        try:
            for base in bases:
                record = await in_service.read_async(redis, base.name)
                if base.trainable:  # one component per trainer shard in service
                    keys = health.trainer_keys(base.name, get_core_settings().trainer_shards)
                    await _workers(redis, components, "trainer", keys, record.trainer_names(list(keys)), keyed)
                if base.sampleable:  # one component per generation replica in service
                    keys = health.gen_keys(base.name, get_core_settings().gen_replicas)
                    await _workers(redis, components, "gen", keys, record.gen_names(list(keys)), keyed)
            raw = await redis.get(health.CELERY_KEY)
            components["celery"] = {"ok": raw is not None, **_aggregates(raw, keyed)}
        except Exception:  # health must report, not raise
            log.warning("health: redis failed mid-report", exc_info=True)
            components["redis"] = {"ok": False}
    ok = all(c["ok"] for c in components.values())
    if not ok:
        response.status_code = 503
    return {"status": "ok" if ok else "degraded", "components": components}


@router.get("/get_server_capabilities")
async def get_server_capabilities(pool: Pool) -> dict:
    """The base models this server serves."""
    async with pool.connection() as conn:
        models = await catalog.list_models(conn)
    return {"supported_models": [m.capability() for m in models]}


@router.post("/client/config")
async def client_config(who: Who, settings: Settings) -> dict:
    """SDK handshake (tinker `ClientConfigResponse`). Only flags whose endpoints exist are turned on:
    plain httpx transport, forward_backward bodies uncompressed, one `retrieve_futures` long-poll per
    sampling session instead of one per sample, copies of a sampling client numbered by the
    server (`join_sampling_session`), custom losses uploaded and run in the trainer's pass
    (`create_custom_loss`), and the key exchanged for auth tokens while
    QUILT_SDK_JWT_AUTH is on (`pjwt_auth_enabled`, api.routes.auth)."""
    return {"use_pyqwest_transport": False, "proto_compress_fwdbwd": False,
            "sample_use_retrieve_futures": True, "sample_join_sampling_session": True,
            "custom_loss_server_side": True,
            "pjwt_auth_enabled": settings.sdk_jwt_auth}


@router.post("/client/dynamic_config")
async def client_dynamic_config(who: Who) -> dict:
    """Refreshed SDK flags (tinker `ClientDynamicConfigResponse`): the defaults."""
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.post("/telemetry")
async def telemetry(who: Who) -> dict:
    """Accept and drop SDK telemetry: nothing leaves a self-hosted installation."""
    return {"status": "accepted"}
