"""Text and structure every route refuses before its own checks run.

Postgres cannot store a NUL character in text or JSON, and a lone UTF-16 surrogate is not
encodable as UTF-8 at all; Python's JSON parser accepts both, and also `NaN`, `Infinity`, `1e999`
and nesting as deep as its recursion limit. So every route of the app is a `GuardedRoute`: before
FastAPI reads the request, its path parameters, query parameters, JSON body and form fields are
checked once, and the first offending value is a 400 naming where it is:

    user_metadata.note: contains a NUL character (U+0000); send text without it

The JSON body is parsed here once, and FastAPI reuses the parsed value (`GuardedRequest.json`).
Numbers keep their own range checks where they are consumed (`core.numbers`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request

from core.errors import Forbidden, InvalidInput
from tenancy import roles

MAX_DEPTH = 32  # levels of JSON objects and arrays; no request shape needs more than a handful

_BAD_CHAR = re.compile("[\x00\ud800-\udfff]")


def text_problem(value: str) -> str | None:
    """Why `value` cannot be stored as text, or None."""
    found = _BAD_CHAR.search(value)
    if found is None:
        return None
    if found.group() == "\x00":
        return "contains a NUL character (U+0000); send text without it"
    return f"contains a lone UTF-16 surrogate (U+{ord(found.group()):04X}); send valid Unicode text"


def check_text(value: str, field: str) -> str:
    problem = text_problem(value)
    if problem:
        raise InvalidInput(f"{field}: {problem}", field=field)
    return value


class _NotFinite:
    """Stands in for NaN, Infinity or an overflowing literal until the walk can name its field."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text


def _parse_float(text: str):
    value = float(text)
    return value if math.isfinite(value) else _NotFinite(text)


def _join(path: str, key) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def check_value(value, where: str = "") -> None:
    """Walk a parsed JSON value without recursion; raise InvalidInput on the first bad part."""
    stack = [(value, where, 1)]
    while stack:
        node, path, depth = stack.pop()
        children: Iterable[tuple[Any, Any]]
        if isinstance(node, dict):
            children = node.items()
        elif isinstance(node, list):
            children = enumerate(node)
        elif isinstance(node, str):
            check_text(node, path or "body")
            continue
        elif isinstance(node, _NotFinite):
            field = path or "body"
            raise InvalidInput(f"{field}: {node.text} is not a finite number", field=field)
        else:
            continue
        if depth > MAX_DEPTH:
            field = path or "body"
            raise InvalidInput(f"{field}: nests deeper than the limit of {MAX_DEPTH} levels", field=field)
        for key, child in children:
            if isinstance(key, str):
                problem = text_problem(key)
                if problem:
                    field = path or "body"
                    raise InvalidInput(f"{field}: a key {problem}", field=field)
            # Numbers, the bulk of a training body, are not pushed: one type test each.
            if isinstance(child, (dict, list, str, _NotFinite)):
                stack.append((child, _join(path, key), depth + 1))


# Objects, arrays and strings are the costly part of a parse (a Python list is 56 bytes and more
# for the 2 bytes of `[]`, a short string about 50 for 4): a body may hold one of each per
# NODE_BYTES of its size, counted before anything is built (a training body holds one per few
# hundred bytes), so a parse costs memory linear in the body with a small constant
# (tests/test_auth_first.py measures it).
NODE_BYTES = 16
MIN_NODES = 256
# A route whose body is a program as data (a custom loss's graph: ten bytes a string as the tinker
# SDK writes it) may hold one per DENSE_NODE_BYTES up to DENSE_BODY_BYTES: fewer nodes in all than
# the largest body allows anyway.
DENSE_NODE_BYTES = 4
DENSE_BODY_BYTES = 1 << 20


def _check_nodes(body: bytes, node_bytes: int = NODE_BYTES) -> None:
    # Brackets and quotes inside strings count too: the bound errs towards refusing, never building.
    limit = max(MIN_NODES, len(body) // node_bytes)
    containers = body.count(b"[") + body.count(b"{")
    strings = body.count(b'"') // 2
    for count, what in ((containers, "objects and arrays"), (strings, "strings")):
        if count > limit:
            raise InvalidInput(f"body: {count} {what} exceed the limit of {limit} for a body of {len(body)} bytes "
                               f"(one per {node_bytes} bytes)", field="body")


def parse_json(body: bytes, *, dense: bool = False):
    """A request body as JSON, checked whole (see the module docstring). `dense`: the route's body
    may hold one node per DENSE_NODE_BYTES while it is at most DENSE_BODY_BYTES."""
    _check_nodes(body, DENSE_NODE_BYTES if dense and len(body) <= DENSE_BODY_BYTES else NODE_BYTES)
    try:
        value = json.loads(body, parse_float=_parse_float, parse_constant=_NotFinite)
    except RecursionError:
        raise InvalidInput(f"body: nests deeper than the limit of {MAX_DEPTH} levels", field="body") from None
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"body: not UTF-8 ({exc.reason} at byte {exc.start})", field="body") from None
    except ValueError as exc:  # JSONDecodeError, and integers past Python's digit limit
        raise InvalidInput(f"body: not valid JSON ({exc})", field="body") from None
    check_value(value)
    return value


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class GuardedRequest(Request):
    """A request whose JSON body was parsed and checked by `GuardedRoute` before FastAPI reads it."""

    dense = False  # set by a DenseBodyRoute

    async def check(self, *, parse_body: bool = True) -> None:
        for name, value in self.path_params.items():
            if isinstance(value, str):
                check_text(value, name)
        if self.scope.get("query_string"):  # most calls have none, and parsing nothing costs a QueryParams
            for name, value in self.query_params.multi_items():
                check_text(name, "query")
                check_text(value, name)
        if not parse_body:
            return
        content_type = self.headers.get("content-type", "")
        if _is_json(content_type):
            body = await self.body()
            if body:
                self._checked = parse_json(body, dense=self.dense)
        elif content_type.startswith(("application/x-www-form-urlencoded", "multipart/form-data")):
            for name, value in (await self.form()).multi_items():
                check_text(name, "form")
                if isinstance(value, str):
                    check_text(value, name)

    async def json(self):
        if not hasattr(self, "_checked"):
            self._checked = parse_json(await self.body(), dense=self.dense)
        return self._checked


class GuardedRoute(APIRoute):
    """The route class of every router in the app (a test holds it to that). A route that takes an
    API key authenticates its caller before anything of the request is read: an anonymous or
    wrongly keyed call is a 401 whatever its body holds, and costs no parse."""

    checks_body = True
    dense_body = False

    def get_route_handler(self):
        from api.deps import authenticate_request, needs_key

        handler = super().get_route_handler()
        keyed = needs_key(self.dependant)
        parse_body = self.checks_body
        path = self.path_format

        async def handle(request: Request):
            guarded = GuardedRequest(request.scope, request.receive)
            guarded.dense = self.dense_body
            if keyed:
                who = await authenticate_request(guarded)
                if not roles.may_call(who.member_role, request.method, path):
                    raise Forbidden(f"this API key is {who.member_role}: it may read, not {request.method} {path}",
                                    field="X-API-Key")
            await guarded.check(parse_body=parse_body)
            return await handler(guarded)

        return handle


class DenseBodyRoute(GuardedRoute):
    """A route whose body is a program as data (`create_custom_loss`): one node per
    DENSE_NODE_BYTES in a body of at most DENSE_BODY_BYTES (`parse_json`)."""

    dense_body = True


class SignedBodyRoute(GuardedRoute):
    """A route whose body is its own credential (Stripe's webhook): the handler verifies the body's
    signature over the raw bytes before anything parses it; path and query are still checked."""

    checks_body = False
