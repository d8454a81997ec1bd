"""An API process that dies mid-request loses nothing: the client's retry with the same ids gets
the same future, and the work runs once.

A second API process, beside the session stack's own and on its stores, is armed to die (as
SIGKILL would: `core.faults`) right after it has committed a request's row and before it has
appended the stream entry: the worst moment, since the database then knows of work no worker
will ever see. The client's retry goes to the stack's healthy API, as a load balancer would send
it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import psycopg
import pytest
from billing_workload import wait_recorded
from stackutil import (
    ADAM,
    ROOT,
    TINY,
    datum,
    fb_body,
    new_model,
    wait_future,
)

from core.faults import CRASH_EXIT_CODE
from stack.ephemeral import free_port

pytestmark = pytest.mark.stack


def _doomed_api(stack, tmp_path) -> tuple[subprocess.Popen, str]:
    # A crash point fires once per data directory: the previous doomed API's marker goes first.
    (stack.data_dir / "crash-points" / "api.after_commit").unlink(missing_ok=True)
    port = free_port()
    env = {**os.environ, "QUILT_DATABASE_URL": stack.database_url, "QUILT_REDIS_URL": stack.redis_url,
           "QUILT_DATA_DIR": str(stack.data_dir), "HF_HUB_OFFLINE": "1", "QUILT_CRASH_AT": "api.after_commit"}
    log = open(tmp_path / f"api-{port}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory", "api.app:create_app", "--host", "127.0.0.1",
                             "--port", str(port)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / f"api-{port}.log").read_text()
        try:
            if httpx.get(url + "/api/v1/healthz", timeout=5).status_code in (200, 503):
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise TimeoutError("the second API did not start")


def _dies_on(proc: subprocess.Popen, url: str, key: str, route: str, body: dict) -> None:
    with pytest.raises(httpx.TransportError):
        httpx.post(f"{url}/api/v1{route}", json=body, headers={"X-API-Key": key}, timeout=60)
    assert proc.wait(timeout=30) == CRASH_EXIT_CODE


def _rows(stack, tenant_id: str, kind: str) -> list[dict]:
    with psycopg.connect(stack.database_url, row_factory=psycopg.rows.dict_row) as conn:
        return conn.execute("SELECT id, status FROM requests WHERE tenant_id = %s AND kind = %s ORDER BY created_at",
                            (tenant_id, kind)).fetchall()


def test_a_retry_after_the_api_died_gets_the_same_future_and_the_work_runs_once(stack, tmp_path):
    tenant = stack.create_tenant("apicrash")
    with stack.http(tenant.key) as c:
        model_id = new_model(c)
        body = fb_body(model_id, 1, [datum([5, 6, 7, 8, 9])])
        proc, url = _doomed_api(stack, tmp_path)
        _dies_on(proc, url, tenant.key, "/forward_backward", body)
        [row] = _rows(stack, tenant.tenant_id, "forward_backward")
        assert row["status"] == "queued"  # recorded, never appended: no worker knows of it

        retried = c.post("/forward_backward", json=body)
        assert retried.status_code == 200, retried.text
        assert retried.json()["request_id"] == row["id"]
        result = wait_future(c, row["id"], timeout_s=120)
        assert "error" not in result, result
        again = c.post("/forward_backward", json=body)  # a late third copy: the same future, not a second run
        assert again.json()["request_id"] == row["id"]
        step = c.post("/optim_step", json={"model_id": model_id, "seq_id": 2, "adam_params": ADAM})
        assert "error" not in wait_future(c, step.json()["request_id"], timeout_s=120)

        session = c.post("/create_session", json={}).json()["session_id"]
        sampler = c.post("/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 0,
                                                           "base_model": TINY}).json()["sampling_session_id"]
        sample = {"sampling_session_id": sampler, "seq_id": 1, "num_samples": 2,
                  "prompt": {"chunks": [{"type": "encoded_text", "tokens": [3, 4, 5]}]},
                  "sampling_params": {"max_tokens": 4, "seed": 1}}
        proc, url = _doomed_api(stack, tmp_path)
        _dies_on(proc, url, tenant.key, "/asample", sample)
        [srow] = _rows(stack, tenant.tenant_id, "sample")
        retried = c.post("/asample", json=sample)
        assert retried.json()["request_id"] == srow["id"]
        result = wait_future(c, srow["id"], timeout_s=300)
        assert "error" not in result and len(result["sequences"]) == 2, result

    wait_recorded(stack.database_url, [tenant.tenant_id])  # answered a moment before the rows commit
    rows = _rows(stack, tenant.tenant_id, "forward_backward") + _rows(stack, tenant.tenant_id, "sample")
    assert [r["status"] for r in rows] == ["done", "done"]
    with psycopg.connect(stack.database_url) as conn:
        billed = conn.execute("SELECT count(*) FROM usage_ledger WHERE request_id = ANY(%s)",
                              ([r["id"] for r in rows],)).fetchone()[0]
    assert billed == 2


def test_a_request_never_queued_and_never_retried_is_failed_unbilled(stack, tenant, r):
    """Its row committed, its entry never appended, its client gone: after ten minutes the minutely
    upkeep fails it with a result a poll reads (not a 410), so it stops counting as in flight."""
    from core import db, queue, records

    ids = {name: f"req-never-{name}-{os.urandom(4).hex()}" for name in ("stale", "appended", "young", "refused")}
    with db.connect(stack.database_url) as conn:
        for name, request_id in ids.items():
            age = "0 seconds" if name == "young" else "20 minutes"
            conn.execute("INSERT INTO requests (id, tenant_id, kind, n_tokens, created_at) "
                         "VALUES (%s, %s, 'sample', 4, now() - %s::interval)", (request_id, tenant.tenant_id, age))
    r.set(queue.enqueued_key(ids["appended"]), b"1", ex=600)  # its entry is in a stream, waiting
    # The tokens-per-minute bucket refused its entry and the API died before deleting the row.
    r.set(queue.enqueued_key(ids["refused"]), b"r12.5", ex=600)
    with db.connect(stack.database_url) as conn:
        assert sorted(records.fail_never_enqueued(conn, r, ttl_s=3600)) == sorted([ids["stale"], ids["refused"]])
        statuses = {row["id"]: row["status"] for row in conn.execute(
            "SELECT id, status FROM requests WHERE id = ANY(%s)", (list(ids.values()),))}
        assert statuses == {ids["stale"]: "failed", ids["appended"]: "queued", ids["young"]: "queued",
                            ids["refused"]: "failed"}
        assert not conn.execute("SELECT 1 FROM usage_ledger WHERE request_id = %s", (ids["stale"],)).fetchone()
        conn.execute("UPDATE requests SET status = 'failed' WHERE id = ANY(%s)", ([ids["appended"], ids["young"]],))
    with stack.http(tenant.key) as http:
        got = http.post("/retrieve_future", json={"request_id": ids["stale"]})
    assert got.status_code == 200 and "never reached a worker" in got.json()["error"], got.text
