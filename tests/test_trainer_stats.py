"""Fused rounds across tenants are visible: per-round records in Redis and Prometheus counters."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import redis
from stackutil import TINY, datum, fb_body, new_model, wait_future


def _trainer(stack, key: str) -> dict:
    """The trainer's counters: healthz shows them to a keyed caller only."""
    return httpx.get(stack.base_url + "/api/v1/healthz", headers={"X-API-Key": key}).json()["components"][
        f"trainer:{TINY}"]


def _metric(stack, name: str) -> float:
    for line in httpx.get(stack.base_url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + "_total{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_two_tenants_share_one_round_and_it_is_reported(stack):
    tenants = [stack.create_tenant(p) for p in ("s1", "s2")]
    clients = [stack.http(t.key) for t in tenants]
    models = [new_model(c) for c in clients]
    before = _metric(stack, "quilt_trainer_tenants_fused")
    pid = _trainer(stack, tenants[0].key)["pid"]
    # Hold the trainer so both requests are queued when it next plans a round.
    os.kill(pid, signal.SIGSTOP)
    try:
        futures = [c.post("/forward_backward", json=fb_body(m, 1, [datum(list(range(7, 30)))])).json()
                   for c, m in zip(clients, models)]
    finally:
        os.kill(pid, signal.SIGCONT)
    for c, f in zip(clients, futures):
        assert "loss:sum" in wait_future(c, f["request_id"])["metrics"]

    # The round's record is pushed after its requests are answered, so give it a moment.
    deadline = time.monotonic() + 10
    while True:
        rounds = [json.loads(r) for r in
                  redis.Redis.from_url(stack.redis_url).lrange(f"quilt:stats:trainer:{TINY}:rounds", 0, 50)]
        shared = [r for r in rounds if r["tenants"] == 2]
        if shared or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert shared and shared[0]["models"] == 2 and shared[0]["tokens"] == 2 * 22
    assert 0.0 <= shared[0]["padding_fraction"] < 1.0

    deadline = time.monotonic() + 10  # the beacon is refreshed every 2 s
    while _metric(stack, "quilt_trainer_tenants_fused") < before + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _metric(stack, "quilt_trainer_tenants_fused") >= before + 2
    assert _metric(stack, "quilt_trainer_busy_seconds") > 0
