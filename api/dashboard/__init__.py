"""The web dashboard, served by the API app under `/dashboard` (same origin as the API).

Tenants log in with an API key and see their runs (loss and client-metric curves), checkpoints
(adapter downloads), samplers, spend and budgets, and manage their keys; operators also see the
pool's health, refreshed live. Pages are Jinja2 templates (`templates/`); the scripts in `static/`
draw plots with uPlot, which `npm ci` in this folder installs (scripts/install.sh runs it): nothing is
fetched from a CDN and no third-party code is committed.

    pages.py           HTML pages and the forms that change things (log in/out, keys)
    data.py            JSON the pages' scripts fetch and poll
    ops.py             the operator's health numbers, from the workers' Redis stats and Postgres
    sessions.py        session cookie, Redis session store, CSRF tokens
    deps.py            session -> tenant, CSRF check, operator gate
    render.py          templates, security headers, error pages
    adapter_archive.py a checkpoint's adapter as a streamed .tar.gz
"""

from __future__ import annotations

import logging
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

from api.dashboard import account, data, members, pages
from api.input_guard import GuardedRoute

log = logging.getLogger("quilt.dashboard")

HERE = Path(__file__).parent
UPLOT_DIST = HERE / "node_modules" / "uplot" / "dist"


async def _to_dashboard() -> RedirectResponse:
    return RedirectResponse(pages.HOME, status_code=307)


def install(app: FastAPI) -> None:
    """Add the dashboard's routes and static files to the API app."""
    app.include_router(pages.router)
    app.include_router(account.router)
    app.include_router(members.router)
    # A person opening the server's address wants the dashboard; SDKs never ask for `/`.
    front = APIRouter(route_class=GuardedRoute, include_in_schema=False)
    front.add_api_route("/", _to_dashboard, methods=["GET", "HEAD"])
    app.include_router(front)
    app.include_router(data.router)
    app.mount("/dashboard/static", StaticFiles(directory=HERE / "static"), name="dashboard-static")
    if not UPLOT_DIST.is_dir():
        # The API must still serve SDK clients; only the dashboard's plots are missing.
        log.warning("%s is missing: the dashboard cannot draw plots; run `npm ci` in %s (scripts/install.sh does)",
                    UPLOT_DIST, HERE)
    app.mount("/dashboard/vendor/uplot", StaticFiles(directory=UPLOT_DIST, check_dir=False), name="dashboard-uplot")
