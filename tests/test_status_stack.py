"""The public status JSON (`/api/v1/status`) against the real stack: a worker goes down when its
beacon expires, a 5xx answered by any API process raises the shared count, an operator's note
appears and nobody else may post one, and notes are bounded."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import psycopg
import pytest
from dashutil import operator_key
from stackutil import TINY, base_sampler, new_model, second_api, wait_future

from api import response_tally, status_board
from core import health

# The status is cached for 2 s per process and counts are published every second: a change shows
# within a few seconds; the deadline leaves room for a loaded machine.
SHOWS_WITHIN_S = 30


def _status(base_url: str) -> dict:
    r = httpx.get(base_url + "/api/v1/status", timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["cache-control"] == "public, max-age=2"
    return r.json()


def _until(base_url: str, check, what: str) -> dict:
    deadline = time.monotonic() + SHOWS_WITHIN_S
    while True:
        doc = _status(base_url)
        if check(doc):
            return doc
        assert time.monotonic() < deadline, f"{what} not shown within {SHOWS_WITHIN_S} s: {doc}"
        time.sleep(0.25)


def _state(doc: dict, component: str) -> str | None:
    return next((c["state"] for c in doc["components"] if c["id"] == component), None)


def _errors_last_minute(doc: dict) -> int:
    return next(w["errors_5xx"] for w in doc["errors"] if w["window_s"] == 60)


@pytest.fixture(scope="module")
def odd_api(stack, tmp_path_factory) -> str:
    """Another API process on the stack's stores that sees the service differently in two ways:
    it expects two trainer shards of the tiny base (the stack runs one unsharded trainer, so the
    shards' beacons are this test's to write), and its Postgres sessions are read-only, so any call
    that writes answers 500 (a real unhandled error, no test hook in the API)."""
    read_only = psycopg.conninfo.make_conninfo(stack.database_url, options="-c default_transaction_read_only=on")
    log_dir = Path(tmp_path_factory.mktemp("odd-api"))
    with second_api(stack, log_dir, QUILT_TRAINER_SHARDS="2", QUILT_DATABASE_URL=read_only) as url:
        yield url


def test_the_page_answers_without_a_key_and_tells_nothing_tenant_specific(stack, tenant):
    doc = _status(stack.base_url)
    assert doc["status"] in ("ok", "degraded") and doc["cached_for_s"] == 2.0
    ids = {c["id"] for c in doc["components"]}
    assert {"api", "postgres", "redis", "celery", f"trainer:{TINY}"} <= ids
    assert _state(doc, "postgres") == "up" and _state(doc, "redis") == "up"
    assert [w["window_s"] for w in doc["errors"]] == [60, 300, 900]
    assert TINY in [b["base_model"] for b in doc["queue_waits"]]
    text = httpx.get(stack.base_url + "/api/v1/status", timeout=30).text
    assert tenant.name not in text and tenant.tenant_id not in text and "pid" not in text


def test_training_and_sampling_waits_reach_the_page(stack, tenant):
    with stack.http(tenant.key) as http:
        new_model(http)  # a create_model goes through a trainer round like any training call
        sampler = base_sampler(http)
        r = http.post("/asample", json={"sampling_session_id": sampler, "num_samples": 1,
                                        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                                        "sampling_params": {"max_tokens": 2}})
        assert r.status_code == 200, r.text
        wait_future(http, r.json()["request_id"])

    def waits(doc: dict) -> dict:
        return next(b for b in doc["queue_waits"] if b["base_model"] == TINY)

    doc = _until(stack.base_url, lambda d: waits(d)["training"] and waits(d)["sampling"], "both waits")
    for side in ("training", "sampling"):
        w = waits(doc)[side]
        assert 0 <= w["p50_s"] <= w["p95_s"] < 600 and w["requests"] >= 1, (side, w)


def test_a_worker_is_down_once_its_beacon_expires(stack, odd_api, r):
    shard = f"trainer:{TINY}@shard-1"
    assert _state(_status(odd_api), shard) == "down"  # nothing ever beat for it
    # A TTL past the page's 2 s cache, so some assembly sees the beacon before it lapses.
    health.beacon(r, health.trainer_key(TINY, "shard-1"), 5, queue_wait_p50_s=0.25, queue_wait_p95_s=7.5,
                  queue_wait_n=3)
    up = _until(odd_api, lambda d: _state(d, shard) == "up", "the shard's beacon")
    waits = next(b for b in up["queue_waits"] if b["base_model"] == TINY)
    assert waits["training"] == {"p50_s": 0.25, "p95_s": 7.5, "requests": 3}
    doc = _until(odd_api, lambda d: _state(d, shard) == "down", "the beacon's expiry")
    assert doc["status"] == "degraded"
    # The stack's own API expects its one unsharded trainer, which beats: no shard there.
    assert _state(_status(stack.base_url), shard) is None


def test_a_5xx_from_any_api_process_raises_the_shared_rate(stack, odd_api, tenant, r):
    first = status_board.bucket_of(time.time())

    def errors_since_start() -> int:
        # Buckets from this test's start on only grow (a window's count also loses old buckets).
        return sum(int(r.hget(response_tally.key(b), "5xx") or 0)
                   for b in range(first, status_board.bucket_of(time.time()) + 1, status_board.BUCKET_S))

    before = errors_since_start()
    r5xx = httpx.post(odd_api + "/api/v1/create_session", json={}, headers={"X-API-Key": tenant.key}, timeout=30)
    assert r5xx.status_code >= 500, r5xx.text
    deadline = time.monotonic() + SHOWS_WITHIN_S
    while (published := errors_since_start()) <= before:  # the odd process publishes once a second
        assert time.monotonic() < deadline, "the 5xx was never published"
        time.sleep(0.25)
    # The stack's own API shows it: the counts are shared, not its process's.
    doc = _until(stack.base_url, lambda d: _errors_last_minute(d) >= published, "the 5xx")
    minute = next(w for w in doc["errors"] if w["window_s"] == 60)
    assert minute["responses"] >= minute["errors_5xx"] > 0 and 0 < minute["error_fraction"] <= 1


def test_an_operators_note_appears_and_is_resolved(stack):
    op = {"X-API-Key": operator_key(stack)}
    title = f"Sampling slow on {TINY} {time.monotonic_ns()}"
    r = httpx.post(stack.base_url + "/api/v1/status/incidents", headers=op, timeout=30,
                   json={"title": title, "body": "We are on it.", "severity": "major"})
    assert r.status_code == 200, r.text
    note = r.json()
    assert note["resolved_at"] is None and note["severity"] == "major"
    doc = _until(stack.base_url, lambda d: any(n["title"] == title for n in d["incidents"]), "the note")
    shown = next(n for n in doc["incidents"] if n["title"] == title)
    assert set(shown) == {"id", "title", "body", "severity", "started_at", "resolved_at"}  # no author
    r = httpx.post(f"{stack.base_url}/api/v1/status/incidents/{note['id']}/resolve", headers=op, json={}, timeout=30)
    assert r.status_code == 200 and r.json()["resolved_at"], r.text
    _until(stack.base_url, lambda d: any(n["title"] == title and n["resolved_at"] for n in d["incidents"]),
           "the resolution")


def test_only_an_operator_may_post(stack, tenant):
    note = {"title": "x", "severity": "minor"}
    url = stack.base_url + "/api/v1/status/incidents"
    r = httpx.post(url, json=note, headers={"X-API-Key": tenant.key}, timeout=30)
    assert r.status_code == 403 and r.json()["field"] == "X-API-Key", r.text
    assert "x-request-id" in r.headers and r.json()["request_id"] == r.headers["x-request-id"]
    assert httpx.post(url, json=note, timeout=30).status_code == 401
    r = httpx.post(url + "/1/resolve", json={}, headers={"X-API-Key": tenant.key}, timeout=30)
    assert r.status_code == 403, r.text


@pytest.mark.parametrize("role", ["member", "read_only"])
def test_an_operator_tenants_keys_short_of_owner_may_not_post(stack, role):
    from core import db
    from tenancy.keys import create_key
    from tenancy.tenants import create_tenant

    with db.connect(stack.database_url) as conn:
        operator = create_tenant(conn, f"op-{time.monotonic_ns()}", role="operator")
        key, _ = create_key(conn, operator.id, role=role)
    r = httpx.post(stack.base_url + "/api/v1/status/incidents", json={"title": "x", "severity": "minor"},
                   headers={"X-API-Key": key}, timeout=30)
    assert r.status_code == 403 and r.json()["field"] == "X-API-Key", r.text


@pytest.mark.parametrize(("change", "field", "says"), [
    ({"title": "t" * 201}, "title", "200"),
    ({"body": "b" * 4001}, "body", "4000"),
    ({"title": "   "}, "title", "blank"),
    ({"title": "a\u0000b"}, "title", "NUL"),
    ({"body": "\ud800"}, "body", "surrogate"),
    ({"severity": "apocalyptic"}, "severity", "minor"),
    ({"started_at": "2026-01-02T00:00:00"}, "started_at", "timezone"),
    ({"started_at": "2026-01-02T00:00:00Z", "resolved_at": "2026-01-01T00:00:00Z"}, "resolved_at", "before"),
])
def test_a_note_out_of_bounds_is_a_400_naming_the_field(stack, change, field, says):
    import json

    op = {"X-API-Key": operator_key(stack), "Content-Type": "application/json"}
    body = json.dumps({"title": "t", "severity": "minor", **change}, ensure_ascii=True)
    r = httpx.post(stack.base_url + "/api/v1/status/incidents", headers=op, content=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["field"] == field and says in r.json()["error"], r.json()


def test_the_page_escapes_a_note(stack):
    op = {"X-API-Key": operator_key(stack)}
    title = f"<script>alert({time.monotonic_ns()})</script>"
    r = httpx.post(stack.base_url + "/api/v1/status/incidents", headers=op, timeout=30,
                   json={"title": title, "body": "<b>bold</b> & <i>more</i>", "severity": "minor",
                         "resolved_at": "2099-01-01T00:00:00Z"})
    assert r.status_code == 200, r.text
    _until(stack.base_url, lambda d: any(n["title"] == title for n in d["incidents"]), "the note")
    page = httpx.get(stack.base_url + "/status", timeout=30)
    assert page.status_code == 200 and page.headers["content-security-policy"].startswith("default-src 'self'")
    assert title not in page.text and "&lt;script&gt;alert(" in page.text
    assert "&lt;b&gt;bold&lt;/b&gt; &amp; &lt;i&gt;more&lt;/i&gt;" in page.text
