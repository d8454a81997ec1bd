"""The FastAPI application factory (`uvicorn --factory api.app:create_app`)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging

from fastapi import FastAPI
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from api import caller_cache, dashboard, errors, links, response_tally
from api.body_limit import BodyLimitMiddleware
from api.caller_cache import CallerCache
from api.routes import (
    account,
    admin,
    auth,
    billing,
    downloads,
    futures,
    metrics,
    openai_compat,
    run_metrics,
    runs,
    sampling,
    service,
    sessions,
    sharing,
    status,
    stripe_webhook,
    training,
)
from api.routes.status import StatusCache
from api.spend_header import SpendHeaderMiddleware
from core import db, loop_lag, redis_client
from core.settings import get_api_settings, get_core_settings, get_security_settings
from tenancy import tokens


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    core = get_core_settings()
    app.state.pool = db.async_pool(db.resolve_url(core))
    await app.state.pool.open(wait=True, timeout=30)
    app.state.redis = redis_client.async_client(redis_client.resolve_url(core))
    app.state.callers = CallerCache(get_api_settings().caller_cache_seconds)
    app.state.verified_tokens = tokens.VerifiedTokens()
    listening = asyncio.create_task(caller_cache.listen(app.state.callers, db.resolve_url(core)))
    lag, probe_s = loop_lag.LagHistogram(), get_api_settings().loop_lag_probe_s
    lag_tasks = [asyncio.create_task(loop_lag.watch(lag, probe_s)),
                 asyncio.create_task(loop_lag.publish(app.state.redis, lag, loop_lag.instance_name()))
                 ] if probe_s else []
    app.state.status_cache = StatusCache()
    tally_task = asyncio.create_task(response_tally.publish(app.state.redis, app.state.tally))
    # What exists at start lives as long as the process: out of the collector's sight, a full
    # collection no longer walks it (those walks were the API's longest pauses under load).
    gc.freeze()
    try:
        yield
    finally:
        for task in (listening, *lag_tasks, tally_task):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await app.state.redis.aclose()
        await app.state.pool.close()


def _add_schema_components(app: FastAPI, components: dict) -> None:
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schemas = build().setdefault("components", {}).setdefault("schemas", {})
            for name, schema in components.items():
                schemas.setdefault(name, schema)
        assert app.openapi_schema is not None  # build() keeps what it made there
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's way to extend the schema it generates


def create_app() -> FastAPI:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    settings = get_api_settings()
    get_security_settings()  # production refuses to start on the embedded QUILT_SECRET_KEY
    # However uvicorn was started (quilt up, a container's command line): QUILT_ACCESS_LOG decides.
    logging.getLogger("uvicorn.access").disabled = not settings.access_log
    app = FastAPI(title="Quilt", version="0.1.0", lifespan=_lifespan)
    app.state.tally = response_tally.ResponseTally()
    errors.install(app, app.state.tally)
    # Starlette tries routes in order until one matches, a microsecond or two each, so the calls
    # every client makes most come first (retrieve_future was the 28th route tried). The order
    # decides nothing else: no path is answered by two of these modules (tests/test_route_order.py).
    for module in (futures, training, sessions, sampling, service, billing, account, runs, admin, downloads,
                   run_metrics, auth, sharing, stripe_webhook, status):
        app.include_router(module.router, prefix="/api/v1")
    app.include_router(metrics.router)
    app.include_router(status.page_router)  # /status, the public page
    app.include_router(openai_compat.router)  # /v1/completions, /v1/chat/completions
    dashboard.install(app)
    _add_schema_components(app, training.SCHEMA_COMPONENTS)
    app.add_middleware(SpendHeaderMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(links.PublicHostMiddleware)
    # Outermost: the client's address and scheme, from the configured proxies' headers only.
    app.add_middleware(ProxyHeadersMiddleware, trusted_hosts=links.trusted_proxies())
    return app
