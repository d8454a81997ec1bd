"""The API's routers are included hottest first (api.app), which is safe only while no path is
answered by routes of two different modules: then the order of modules changes nothing but speed."""

from __future__ import annotations

import re

from starlette.routing import Match

from api.app import create_app


def _module(route) -> str:
    return getattr(getattr(route, "endpoint", None), "__module__", type(route).__name__)


def test_no_path_is_answered_by_two_modules():
    routes = create_app().router.routes
    clashes = []
    for route in routes:
        if getattr(route, "path", None) is None:
            continue
        path = re.sub(r"\{[^}]+\}", "x", route.path)
        for method in getattr(route, "methods", None) or {"GET"}:
            scope = {"type": "http", "path": path, "method": method, "root_path": ""}
            clashes += [(route.path, method, _module(other)) for other in routes
                        if other is not route and _module(other) != _module(route)
                        and other.matches(scope)[0] == Match.FULL]
    assert not clashes


def test_the_hottest_calls_are_tried_first():
    paths = [getattr(r, "path", "") for r in create_app().router.routes if _module(r).startswith("api.")]
    assert paths.index("/api/v1/retrieve_future") < 3
    assert paths.index("/api/v1/get_info") < paths.index("/api/v1/healthz")
