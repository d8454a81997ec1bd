"""HTML rendering for the dashboard: the templates, the headers every page carries, and the route
class that turns errors on pages into pages (a 404 page, a login redirect) instead of JSON."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import quote, urlencode

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.templating import Jinja2Templates
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.errors import request_id_of, retry_after
from api.input_guard import GuardedRoute
from billing.pricing import usd
from core.errors import (
    InvalidInput,
    QuiltError,
    QuotaExceeded,
    ServerError,
    Unauthenticated,
)

log = logging.getLogger("quilt.dashboard")

HERE = Path(__file__).parent
templates = Jinja2Templates(directory=HERE / "templates")


def _when(value: datetime | None) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC") if value else "–"


def _filesize(n: int | None) -> str:
    size = float(n or 0)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"


templates.env.filters.update(urlquote=lambda value: quote(str(value), safe=""), when=_when, filesize=_filesize,
                             usd=usd)

# Scripts, styles and images come only from this origin (nothing from a CDN, no inline script);
# pages cannot be framed; nothing is cached, since pages show account data and a new key's secret.
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def csp_with_form_action(origin: str) -> str:
    """The pages' policy with one more origin forms may go to (a redirect counts)."""
    return HEADERS["Content-Security-Policy"].replace("form-action 'self'", f"form-action 'self' {origin}")


def page(request: Request, template: str, context: dict, *, status_code: int = 200) -> HTMLResponse:
    """Render a page. `context` may hold `viewer` (the logged-in tenant, for the menu and the CSRF
    token of its forms)."""
    return templates.TemplateResponse(request, template, context, status_code=status_code)


def login_redirect(request: Request) -> RedirectResponse:
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse("/dashboard/login?" + urlencode({"next": target}), status_code=303)


def _error_page(request: Request, exc: QuiltError) -> HTMLResponse:
    rid = request_id_of(request)
    level = logging.WARNING if exc.status_code < 500 else logging.ERROR
    log.log(level, "%s %s -> %d %s", request.method, request.url.path, exc.status_code, exc.message,
            extra={"request_id": rid, "tenant_id": getattr(request.state, "tenant_id", None)})
    response = page(request, "error.html", {"status": exc.status_code, "message": exc.message, "request_id": rid},
                    status_code=exc.status_code)
    if isinstance(exc, QuotaExceeded):
        response.headers["Retry-After"] = retry_after(exc.retry_after_s)
    return response


class PageRoute(GuardedRoute):
    """Routes that answer HTML: a missing session sends a GET to the login page; any other error
    becomes an error page with the same status code (another tenant's run is a 404 page)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                response = await handler(request)
            except Unauthenticated as exc:
                response = login_redirect(request) if request.method == "GET" else _error_page(request, exc)
            except QuiltError as exc:
                response = _error_page(request, exc)
            except RequestValidationError as exc:
                first = exc.errors()[0]
                field = ".".join(str(p) for p in first.get("loc", ())[1:]) or "request"
                response = _error_page(request, InvalidInput(f"{field}: {first.get('msg', 'invalid value')}",
                                                             field=field))
            except StarletteHTTPException as exc:
                err = ServerError(str(exc.detail))
                err.status_code = exc.status_code
                response = _error_page(request, err)
            for name, value in HEADERS.items():  # a page may widen one (the billing page's form-action)
                response.headers.setdefault(name, value)
            return response

        return handle


class DataRoute(GuardedRoute):
    """JSON routes the dashboard's scripts poll: errors stay JSON (the app's handlers); answers are
    never cached."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            response = await handler(request)
            response.headers["Cache-Control"] = "no-store"
            return response

        return handle
