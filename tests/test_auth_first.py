"""Authenticate first: a call without a valid key is a 401 before its body is read, whatever the body
holds; a body that is read costs memory linear in its size with a small constant; Stripe's webhook
checks its signature before anything parses the body."""

from __future__ import annotations

import json
import tracemalloc

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from api.input_guard import NODE_BYTES, SignedBodyRoute, parse_json
from core.errors import InvalidInput

# Each would be a 400 naming a field if it were parsed before the key was checked.
HOSTILE = {
    "NUL": b'{"user_metadata": {"a": "\\u0000"}}',
    "surrogate": b'{"user_metadata": {"a": "\\ud800"}}',
    "deep": b"[" * 5000 + b"]" * 5000,
    "not JSON": b"{" * 3,
    "NaN": b'{"x": NaN}',
}


@pytest.mark.parametrize("name", list(HOSTILE))
@pytest.mark.parametrize("key", [None, "tml-not-a-key"])
def test_an_unauthenticated_call_is_a_401_whatever_its_body(stack, name, key):
    with stack.http(key) as client:
        r = client.post("/create_session", content=HOSTILE[name], headers={"content-type": "application/json"})
    assert r.status_code == 401, r.text
    assert r.json()["field"] in ("X-API-Key", "api_key")


def test_a_large_anonymous_body_is_refused_unread(stack):
    # 8 MiB of arrays: a parse would build about half a gigabyte of lists (and be a 400).
    body = b"[" + b"[]," * ((8 << 20) // 3) + b"[]]"
    with stack.http(None) as client:
        r = client.post("/forward_backward", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 401, r.text


def test_an_authenticated_call_still_gets_its_field_errors(stack, tenant):
    with stack.http(tenant.key) as client:
        r = client.post("/create_session", content=HOSTILE["NUL"], headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["field"] == "user_metadata.a", r.text


@pytest.mark.parametrize("body", [b"[" + b"[]," * 1000 + b"[]]", b"[" + b'"a",' * 1000 + b'"a"]'])
def test_too_many_arrays_or_strings_for_the_body_size_is_a_400_naming_the_limit(body):
    with pytest.raises(InvalidInput, match="exceed the limit") as err:
        parse_json(body)
    assert err.value.field == "body"
    parse_json(json.dumps({"data": [[1, 2, 3]] * 10}).encode())  # ordinary shapes pass


def _peak(body: bytes) -> int:
    tracemalloc.start()
    try:
        parse_json(body)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("shape", ["arrays", "objects", "short strings", "floats", "training body"])
def test_a_parse_costs_memory_linear_in_the_body_with_a_small_constant(shape):
    n = 1 << 18
    per = NODE_BYTES + 1
    body = {
        # As many containers as the bound allows, padded to the bytes they need.
        "arrays": "[" + ",".join(["[" + " " * (per - 3) + "]"] * n) + "]",
        "objects": "[" + ",".join(["{" + " " * (per - 3) + "}"] * n) + "]",
        "short strings": "[" + ",".join(f'"{i % 97:02d}"' + " " * (per - 5) for i in range(n)) + "]",
        "floats": "[" + ",".join("0.5" for _ in range(n)) + "]",
        "training body": json.dumps({"data": [{"target_tokens": {"data": list(range(200)), "shape": [200]},
                                              "weights": {"data": [1.0] * 200}} for _ in range(n // 400)]}),
    }[shape].encode()
    ratio = _peak(body) / len(body)
    print(f"{shape}: parse peak {ratio:.1f}x the body")
    assert ratio < 16


def test_a_signed_body_route_leaves_the_body_to_its_handler():
    app = FastAPI()
    app.router.route_class = SignedBodyRoute

    @app.post("/hook")
    async def hook(request: Request) -> dict:
        return {"bytes": len(await request.body())}
    with TestClient(app) as client:
        r = client.post("/hook", content=HOSTILE["NUL"], headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json() == {"bytes": len(HOSTILE["NUL"])}


def test_the_anonymous_health_answers_carry_no_store_errors_or_tenant_figures(stack):
    import httpx

    health = httpx.get(stack.base_url + "/api/v1/healthz", timeout=10).json()
    assert health["status"] in ("ok", "degraded") and "postgres" in health["components"]
    for name, component in health["components"].items():
        assert set(component) <= {"ok", "leaving"}, (name, component)  # up or down, nothing else
    assert set(health["components"]["postgres"]) == {"ok"} and set(health["components"]["redis"]) == {"ok"}
    ready = httpx.get(stack.base_url + "/api/v1/readyz", timeout=10).json()
    assert all(set(check) == {"ok"} for check in ready["checks"].values()), ready


def test_a_keyed_health_answer_adds_the_pools_counters_and_a_wrong_key_is_a_401(stack, tenant):
    import httpx
    from stackutil import TINY

    keyed = httpx.get(stack.base_url + "/api/v1/healthz", headers={"X-API-Key": tenant.key}, timeout=10).json()
    trainer = keyed["components"][f"trainer:{TINY}"]
    assert trainer["ok"] and "at" in trainer
    assert all(not isinstance(v, (dict, list)) for v in trainer.values())  # no per-tenant figures
    wrong = httpx.get(stack.base_url + "/api/v1/healthz", headers={"X-API-Key": "tml-wrong"}, timeout=10)
    assert wrong.status_code == 401
