"""Turn every error into a JSON body with a category and the request id, and log it with context."""

from __future__ import annotations

import logging
import math
import secrets
import time

import psycopg
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from api import seq_gaps
from api.response_tally import ResponseTally
from core import waits
from core.errors import InvalidInput, InvalidToken, QuiltError, ServerError, Unavailable, UserError
from core.stores import STORE_ERRORS

log = logging.getLogger("quilt.api")

REQUEST_ID_HEADER = "X-Request-ID"


_RID_HEADER = REQUEST_ID_HEADER.lower().encode()

# Left out of the status page's response counts (api.response_tally): probes answer 503 to report a
# component down, not as a failure of their own, and monitors and status readers poll them far more
# often than clients call, which would drown the share of 5xx that callers see.
UNTALLIED = frozenset({"/api/v1/healthz", "/api/v1/readyz", "/api/v1/livez", "/metrics", "/status",
                       "/api/v1/status"})


def request_id_of(request: Request) -> str:
    """The request's id: the caller's X-Request-ID, or one made for it (kept as `request.state.request_id`)."""
    return _request_id(request.scope)


def _request_id(scope) -> str:
    # On the scope's own state dict (what `request.state` reads) and raw headers (lowercased by the
    # server): wrapping them in Starlette's Request, State and Headers cost a cheap call 4% of its CPU.
    state = scope.setdefault("state", {})
    rid = state.get("request_id")
    if rid is None:
        rid = next((v.decode("latin-1") for k, v in scope["headers"] if k == _RID_HEADER), "") or \
            "http-" + secrets.token_hex(8)
        state["request_id"] = rid
    return rid


def retry_after(seconds: float) -> str:
    """A Retry-After header's value: whole seconds, at least one."""
    return str(max(1, math.ceil(seconds)))


def _respond(request: Request, err: QuiltError) -> JSONResponse:
    err.request_id = err.request_id or request_id_of(request)
    headers = {REQUEST_ID_HEADER: err.request_id}
    if err.status_code in (429, 503):
        headers["Retry-After"] = retry_after(getattr(err, "retry_after_s", 1.0))
    if isinstance(err, InvalidToken):
        headers["WWW-Authenticate"] = err.www_authenticate
    level = logging.WARNING if isinstance(err, UserError) else logging.ERROR
    log.log(level, "%s %s -> %d %s", request.method, request.url.path, err.status_code, err.message,
            extra={"request_id": err.request_id, "tenant_id": getattr(request.state, "tenant_id", None)})
    return JSONResponse(err.to_json(), status_code=err.status_code, headers=headers)


def _field_of(loc: tuple) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or "body"


class RequestIdMiddleware:
    """Every response carries the request id (the caller's X-Request-ID, or a new one) and
    `Server-Timing: app;dur=MS`, the time from the request reaching the app to its answer starting
    (the API's own part of a call), followed by what it waited on meanwhile (core.waits: `pool`,
    `pg`, `redis`; bench/api_load.py reads them). With a `tally`, it counts each response's status for
    the status page (api.response_tally), probes left out (UNTALLIED). Pure ASGI: Starlette's
    BaseHTTPMiddleware cost a tenth of a cheap call's CPU (bench/api_load.py)."""

    _TIMING = b"server-timing"

    def __init__(self, app, tally: ResponseTally | None = None):
        self.app = app
        # Counted here, where every response starts, rather than in a middleware of its own: one
        # more ASGI layer would add a call and a closure to every request for two integer additions.
        self.tally = tally

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        spent = waits.tally()
        rid = _request_id(scope)

        started_status = None

        async def send_with_id(message):
            nonlocal started_status
            if message["type"] == "http.response.start":
                started_status = message["status"]
                headers = list(message.get("headers", []))
                if not any(name.lower() == _RID_HEADER for name, _ in headers):
                    headers.append((_RID_HEADER, rid.encode("latin-1", "replace")))
                headers.append((self._TIMING, b"app;dur=%.3f, %s" % ((time.perf_counter() - started) * 1000,
                                                                     waits.server_timing(spent))))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            # An unhandled error is answered outside this middleware (Starlette's outermost
            # ServerErrorMiddleware runs the `Exception` handler): a 500 unless one had started.
            if self.tally is not None and scope["path"] not in UNTALLIED:
                self.tally.add(started_status or 500)
            raise
        if self.tally is not None and started_status is not None and scope["path"] not in UNTALLIED:
            self.tally.add(started_status)


def install(app: FastAPI, tally: ResponseTally | None = None) -> None:
    """The error handlers, and the middleware giving every response its request id (and counting
    it in `tally`, for the status page)."""
    app.add_middleware(RequestIdMiddleware, tally=tally)

    @app.exception_handler(QuiltError)
    async def _quilt(request: Request, exc: QuiltError):
        await seq_gaps.fill(request, exc)
        return _respond(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        field = _field_of(tuple(first.get("loc", ())))
        msg = first.get("msg", "invalid value").removeprefix("Value error, ")
        err = InvalidInput(f"{field}: {msg}", field=field)
        seq_gaps.claim_from_body(request, exc.body)
        await seq_gaps.fill(request, err)
        return _respond(request, err)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        cls = UserError if exc.status_code < 500 else ServerError
        err = cls(str(exc.detail))
        err.status_code = exc.status_code
        return _respond(request, err)

    @app.exception_handler(psycopg.errors.DataError)
    async def _data(request: Request, exc: psycopg.errors.DataError):
        # The edge checks text and numbers (api.input_guard, core.numbers); a value that still does
        # not fit its column is the caller's input all the same: a 400, logged to close the gap.
        log.warning("database refused a value on %s %s: %s", request.method, request.url.path, exc)
        primary = exc.diag.message_primary or type(exc).__name__
        return _respond(request, InvalidInput(f"body: a value does not fit what it is stored in ({primary})",
                                              field="body"))

    async def _store_down(request: Request, exc: Exception):
        # Never a 500 while a store restarts: 503 with Retry-After, which both SDKs retry.
        log.warning("store unavailable on %s %s: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        return _respond(request, Unavailable(f"a store is unavailable ({type(exc).__name__}); retry in a moment"))

    for store_error in STORE_ERRORS:
        app.add_exception_handler(store_error, _store_down)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _respond(request, ServerError("internal error; it has been logged with this request id"))
