"""Two generation replicas per base (`quilt up --gen-replicas 2`), each a real vLLM engine: the API
routes each tenant's groups to the replica that holds its adapter, healthz reports each replica,
and a replica that stops answering (frozen with SIGSTOP, so the launcher does not restart it) has
its queued groups moved to the live one after QUILT_GEN_TAKEOVER_S: the client sees latency, not
an error, and each group is billed once."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import openai
import psycopg
import pytest
import quilt
from billing_workload import wait_recorded
from stackutil import TINY

from core import db, health, queue, redis_client
from stack.ephemeral import ephemeral_stack, new_tenant

pytestmark = pytest.mark.stack
TAKEOVER_S = 5


@pytest.fixture(scope="module")
def replicas_stack():
    with ephemeral_stack({"QUILT_GEN_TAKEOVER_S": str(TAKEOVER_S)}, gen_replicas=2) as s:
        yield s


def _beacons(r) -> dict[str, dict | None]:
    return {name: json.loads(raw) if (raw := r.get(health.gen_key(TINY, name))) else None
            for name in queue.replica_names(2)}


def _holder(r, adapter_key_part: str) -> list[str]:
    return [name for name, b in _beacons(r).items()
            if b and any(adapter_key_part in k for k in b.get("routing", {}).get("adapters", []))]


def test_groups_stay_with_their_adapter_and_survive_a_frozen_replica(replicas_stack):
    s = replicas_stack
    r = redis_client.sync_client(s.redis_url)
    health_now = httpx.get(f"{s.base_url}/api/v1/healthz", timeout=10).json()["components"]
    assert health_now[f"gen:{TINY}@gen-0"]["ok"] and health_now[f"gen:{TINY}@gen-1"]["ok"]

    tenants = [new_tenant(s, f"rep-{i}") for i in range(2)]
    clients = [quilt.Client(api_key=key, base_url=s.base_url) for _, key in tenants]
    samplers = []
    for i, client in enumerate(clients):
        tc = client.create_training_client(TINY, rank=4, seed=i)
        samplers.append((tc.model_id, tc.save_weights_and_get_sampling_client(f"rep-{i}")))
    params = quilt.SamplingParams(max_tokens=8, seed=1, stop=[])
    for _ in range(3):
        for _, sampler in samplers:
            assert len(sampler.sample([5, 6, 7], 2, params).result(timeout=300).sequences) == 2
    time.sleep(2.5)  # a beacon or two
    homes = {model_id: _holder(r, model_id) for model_id, _ in samplers}
    assert all(len(h) == 1 for h in homes.values()), homes  # every group of a tenant went to one replica
    beacons = _beacons(r)
    hits = sum(b["adapter_hits"] for b in beacons.values())
    misses = sum(b["adapter_misses"] for b in beacons.values())
    assert misses == 2 and hits == 4, beacons  # one load per adapter, then hits

    # Freeze the replica holding tenant 0's adapter while it runs three of its groups: once its
    # liveness key lapses the other replica takes them (moved off its stream, in flight or not).
    model_id, sampler = samplers[0]
    (frozen,) = homes[model_id]
    pid, stream = beacons[frozen]["pid"], queue.sample_stream(TINY, frozen)
    long = quilt.SamplingParams(max_tokens=300, seed=2, stop=[])
    futures = [sampler.sample([5, 6, 7, k], 2, long) for k in range(3)]
    deadline = time.monotonic() + 120
    while r.xpending(stream, queue.SAMPLE_GROUP)["pending"] < 3:
        assert time.monotonic() < deadline, "the frozen replica never took the three groups"
        time.sleep(0.01)
    # A frozen process may be caught inside a settle's transaction: a session under the replica's
    # name holds the groups' request rows, which the re-runs' settles must not wait on.
    held = psycopg.connect(s.database_url, application_name=db.session_name("gen", frozen, TINY))
    held.execute("SELECT id FROM requests WHERE tenant_id = %s AND kind = 'sample' AND status <> 'done' FOR UPDATE",
                 (tenants[0][0],))
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        outs = [f.result(timeout=300) for f in futures]
        moved_after_s = time.monotonic() - started
        assert all(len(o.sequences) == 2 and all(len(q.tokens) == 300 for q in o.sequences) for o in outs)
        assert r.xlen(stream) == 0 and r.xpending(stream, queue.SAMPLE_GROUP)["pending"] == 0
        print(f"frozen replica {frozen}: its 3 in-flight groups were answered by the other {moved_after_s:.1f} s "
              f"later (QUILT_GEN_TAKEOVER_S={TAKEOVER_S})")
    finally:
        os.kill(pid, signal.SIGCONT)
    with pytest.raises(psycopg.OperationalError):
        held.execute("SELECT 1")  # ended by the replica that took the groups over
    held.close()
    # Back: its beacon returns and it takes work again.
    deadline = time.monotonic() + 60
    while _beacons(r)[frozen] is None:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert len(sampler.sample([5, 6, 7], 2, params).result(timeout=300).sequences) == 2

    ids = [t for t, _ in tenants]
    wait_recorded(s.database_url, ids)
    with db.connect(s.database_url) as conn:
        rows = conn.execute(
            "SELECT r.status, (SELECT count(*) FROM usage_ledger u WHERE u.request_id = r.id) AS billed "
            "FROM requests r WHERE r.tenant_id = ANY(%s) AND r.kind = 'sample'", (ids,)).fetchall()
    assert len(rows) == 10 and all((row["status"], row["billed"]) == ("done", 1) for row in rows), rows
    for client in clients:
        client.close()


def test_a_stream_whose_replica_freezes_is_finished_by_the_other_without_repeats(replicas_stack):
    """The other replica samples the seeded sequence again from its start; the stream skips what
    it already sent, so the client's text is the result's, once."""
    s = replicas_stack
    r = redis_client.sync_client(s.redis_url)
    _, key = new_tenant(s, "rep-stream")
    client = openai.OpenAI(base_url=f"{s.base_url}/v1", api_key=key, max_retries=0, timeout=300)
    plain = client.completions.create(model=TINY, prompt="bob has", max_tokens=400, seed=11)
    stream = iter(client.completions.create(model=TINY, prompt="bob has", max_tokens=400, seed=11, stream=True))
    first = next(stream)  # sampling is under way
    pieces = [first.choices[0].text]
    holder = next(n for n in queue.replica_names(2)
                  if r.xpending(queue.sample_stream(TINY, n), queue.SAMPLE_GROUP)["pending"])
    pid = _beacons(r)[holder]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        pieces += [c.choices[0].text for c in stream if c.choices]
    finally:
        os.kill(pid, signal.SIGCONT)
    assert "".join(pieces) == plain.choices[0].text
    starts = [f for _, f in r.xrange(queue.delta_key(first.id.removeprefix("cmpl-"))) if f[b"o"] == b"0"]
    assert len(starts) == 2, "the sequence was not sampled again: nothing was tested"
