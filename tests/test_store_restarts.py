"""Redis and Postgres stopped and started again under a running stack (what an operator's restart
or a failover does): while a store is down the API answers 503 with Retry-After, never 500 and
never a hang; the workers wait it out and carry on once it is back (none exits); an SDK client training and sampling through
both outages finishes every call, and every request is done and billed once.

Redis is stopped with SHUTDOWN (its append-only file is complete) and started from the same
configuration; Postgres with pg_ctl's fast mode. A crash of Redis (SIGKILL) may lose its last
second of writes under `appendfsync everysec`: docs/concepts/durability.md says what that costs."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import quilt
from billing_workload import wait_recorded
from stackutil import TINY

from core import db, embedded

pytestmark = pytest.mark.stack

OUTAGE_S = 4.0


class Prober(threading.Thread):
    """Calls the API every 50 ms and counts the statuses (and whether 503s carry Retry-After)."""

    def __init__(self, stack, key: str):
        super().__init__(daemon=True)
        self.client = httpx.Client(base_url=stack.base_url + "/api/v1", headers={"X-API-Key": key}, timeout=30)
        self.statuses: dict[int, int] = {}
        self.without_retry_after = 0
        self.slowest_s = 0.0
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            started = time.monotonic()
            try:
                r = self.client.post("/create_session", json={})
                status = r.status_code
                if status == 503 and "retry-after" not in r.headers:
                    self.without_retry_after += 1
            except httpx.TransportError:
                status = 0
            self.slowest_s = max(self.slowest_s, time.monotonic() - started)
            self.statuses[status] = self.statuses.get(status, 0) + 1
            time.sleep(0.05)


def test_redis_and_postgres_restarts_lose_nothing(stack, tenant):
    results: list = []
    errors: list[BaseException] = []

    def workload() -> None:
        try:
            with stack.sdk(tenant.key) as client:
                tc = client.create_training_client(TINY, rank=4, seed=0)
                sampler = client.create_sampling_client(base_model=TINY)
                for step in range(12):
                    fb = tc.forward_backward([quilt.datum_for_next_token([5, 6, 7, 8, 9 + step])], "cross_entropy")
                    opt = tc.optim_step(quilt.AdamParams(learning_rate=1e-3))
                    sample = sampler.sample([5, 6, 7], 2, quilt.SamplingParams(max_tokens=8, seed=step, stop=[]))
                    results.append((fb.result(timeout=600), opt.result(timeout=600), sample.result(timeout=600)))
                    time.sleep(0.5)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    launcher_log = stack.data_dir / "up.out"
    restarts_before = launcher_log.read_text().count("restarting (see")
    prober = Prober(stack, tenant.key)
    prober.start()
    worker = threading.Thread(target=workload, daemon=True)
    worker.start()
    time.sleep(3)
    embedded.restart_redis(stack.redis_url, OUTAGE_S)
    time.sleep(3)
    embedded.restart_postgres(stack.data_dir, OUTAGE_S)
    worker.join(timeout=900)
    prober.stopped.set()
    prober.join(timeout=60)
    print("prober statuses during the restarts:", prober.statuses, f"slowest {prober.slowest_s:.2f} s")

    assert not errors, errors
    # The workers waited the outages out: none exited for the launcher to restart (and the launcher,
    # which records the servers' new pids, is still there to have done so).
    assert launcher_log.read_text().count("restarting (see") == restarts_before, launcher_log.read_text()[-3000:]
    assert len(results) == 12
    assert set(prober.statuses) <= {200, 503}, prober.statuses
    assert prober.statuses.get(503, 0) > 0  # the outages were seen, and answered as 503
    assert prober.without_retry_after == 0
    wait_recorded(stack.database_url, [tenant.tenant_id])  # answered a moment before the rows commit
    with db.connect(stack.database_url) as conn:
        rows = conn.execute(
            "SELECT r.kind, r.status, (SELECT count(*) FROM usage_ledger u WHERE u.request_id = r.id) AS billed "
            "FROM requests r WHERE r.tenant_id = %s AND r.kind IN ('forward_backward', 'optim_step', 'sample')",
            (tenant.tenant_id,)).fetchall()
    assert len(rows) == 36
    assert {(r["status"], r["billed"]) for r in rows} == {("done", 1)}, rows
