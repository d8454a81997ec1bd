"""Scale-out on one machine: `quilt up --api-replicas 2 --gen-replicas 2 --trainer-shards 2`, every
generation replica a real vLLM engine, one stack for the module.

Generation replicas: the API routes each tenant's groups to the replica that holds its adapter,
healthz reports each replica, and a replica that stops answering (frozen with SIGSTOP, so the
launcher does not restart it) has its queued groups moved to the live one after
QUILT_GEN_TAKEOVER_S: the client sees latency, not an error, and each group is billed once.

Trainer shards: four tenants train and sample through both API processes, their models spread
over the two shards (placement in Postgres). A shard that stops answering has its models
re-placed on the live shard after QUILT_TRAINER_TAKEOVER_S: restored from their snapshots, the
requests since replayed, the queued ones run, the weights and AdamW state equal to an
uninterrupted run; woken, it finds itself fenced and restarts holding nothing it lost. `quilt
trainers drain` moves a shard's models off it with their state intact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import psycopg
import pytest
import quilt
from billing_workload import wait_recorded
from durable_reference import ADAM, SEQS, assert_recovered, calls_after, calls_before
from stackutil import ROOT, TINY, datum, fb_body, new_model, wait_future

from core import db, health, queue, redis_client
from scaleout import placement
from stack.ephemeral import ephemeral_stack, new_tenant

pytestmark = pytest.mark.stack
TAKEOVER_S = 5
SHARDS = queue.shard_names(2)


@pytest.fixture(scope="module")
def replicas_stack():
    with ephemeral_stack({"QUILT_GEN_TAKEOVER_S": str(TAKEOVER_S), "QUILT_TRAINER_TAKEOVER_S": str(TAKEOVER_S)},
                         api_replicas=2, gen_replicas=2, trainer_shards=2) as s:
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


# ------------------------------------------------------------------ trainer shards

def _placed(s, model_ids: list[str]) -> dict[str, str]:
    with db.connect(s.database_url) as conn:
        return {r["id"]: r["trainer_shard"] for r in conn.execute(
            "SELECT id, trainer_shard FROM training_models WHERE id = ANY(%s)", (model_ids,))}


def _held(s) -> dict[str, int]:
    """Live models placed on each shard."""
    with db.connect(s.database_url) as conn:
        rows = conn.execute("SELECT trainer_shard, count(*) AS n FROM training_models WHERE status = ANY(%s) "
                            "GROUP BY trainer_shard", (list(placement.LIVE_STATUSES),)).fetchall()
    return {name: 0 for name in SHARDS} | {r["trainer_shard"]: r["n"] for r in rows}


def _beacon(r, shard: str) -> dict | None:
    raw = r.get(health.trainer_key(TINY, shard))
    return json.loads(raw) if raw else None


def _until(what: str, check, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout_s} s"
        time.sleep(0.2)
    return value


def _quilt(s, *args: str) -> subprocess.CompletedProcess:
    env = {"QUILT_DATA_DIR": str(s.data_dir), "QUILT_DATABASE_URL": s.database_url, "QUILT_REDIS_URL": s.redis_url,
           "QUILT_TRAINER_SHARDS": "2", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "stack.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_four_tenants_train_and_sample_over_two_shards(replicas_stack):
    s = replicas_stack
    r = redis_client.sync_client(s.redis_url)
    components = httpx.get(f"{s.base_url}/api/v1/healthz", timeout=10).json()["components"]
    assert all(components[f"trainer:{TINY}@{name}"]["ok"] for name in SHARDS), components

    tenants = [new_tenant(s, f"shard-t{i}") for i in range(4)]
    clients = [quilt.Client(api_key=key, base_url=s.api_urls[i % 2]) for i, (_, key) in enumerate(tenants)]
    trainers = [c.create_training_client(TINY, rank=4, seed=i) for i, c in enumerate(clients)]
    placed = _placed(s, [tc.model_id for tc in trainers])
    assert set(placed.values()) == set(SHARDS), placed
    held = _held(s)  # with the models of the tests before: the least loaded shard took each new one
    assert abs(held["shard-0"] - held["shard-1"]) <= 1, held

    data = [quilt.datum_for_next_token([5, 6, 7, 8, 9, 10])]
    losses = {tc.model_id: [tc.train_step(data, "cross_entropy", quilt.AdamParams(learning_rate=1e-2)).loss
                            for _ in range(3)] for tc in trainers}
    assert all(ls[-1] < ls[0] for ls in losses.values()), losses  # each model learns on its own shard
    # Each shard's load for placement counts the tokens it trained in the last minute: read it now,
    # since the sampling below can outlast that minute on a slow host (seen in CI).
    _until("both shards' beacons to count their recent tokens",
           lambda: all((b := _beacon(r, n)) and b.get("recent_tokens", 0) > 0 for n in SHARDS))
    params = quilt.SamplingParams(max_tokens=6, seed=1, stop=[])
    for i, tc in enumerate(trainers):
        sampler = tc.save_weights_and_get_sampling_client(f"shard-s{i}")
        assert len(sampler.sample([5, 6, 7], 2, params).result(timeout=300).sequences) == 2

    _until("both shards' beacons to show their models",
           lambda: all((b := _beacon(r, n)) and b.get("models") == held[n] for n in SHARDS))
    listed = _quilt(s, "trainers", "list")
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[0]: line.split() for line in listed.stdout.splitlines() if line.startswith("shard-")}
    assert [rows[n][1:4] for n in SHARDS] == [["yes", "no", str(held[n])] for n in SHARDS], listed.stdout
    ids = [t for t, _ in tenants]
    wait_recorded(s.database_url, ids)
    with db.connect(s.database_url) as conn:
        billed = conn.execute("SELECT r.status, count(u.id) AS n FROM requests r LEFT JOIN usage_ledger u "
                              "ON u.request_id = r.id WHERE r.tenant_id = ANY(%s) GROUP BY r.id, r.status",
                              (ids,)).fetchall()
    assert billed and all((b["status"], b["n"]) == ("done", 1) for b in billed), billed
    for c in clients:
        c.close()


def test_a_dead_shards_models_resume_on_the_other_at_their_last_step(replicas_stack):
    s = replicas_stack
    r = redis_client.sync_client(s.redis_url)
    _, key = new_tenant(s, "shard-durable")
    client = httpx.Client(base_url=s.base_url + "/api/v1", headers={"X-API-Key": key}, timeout=60)
    other_api = httpx.Client(base_url=s.api_urls[1] + "/api/v1", headers={"X-API-Key": key}, timeout=60)
    model_id = new_model(client, rank=8, seed=0)
    home = _placed(s, [model_id])[model_id]
    for route, body in calls_before(model_id):
        assert "error" not in wait_future(client, client.post(route, json=body).json()["request_id"])
    # seq 3's gradients live only in the frozen shard's memory; its answer has been given. As a
    # frozen process may be caught inside a transaction, a session under the shard's name holds
    # the model's row locked: re-placing the model must end it, not wait on it.
    held = psycopg.connect(s.database_url, application_name=db.session_name("trainer", home, TINY))
    held.execute("SELECT 1 FROM training_models WHERE id = %s FOR UPDATE", (model_id,))
    pid = _beacon(r, home)["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        submitted = [api.post(route, json=body) for api, (route, body)  # the two API replicas in turn
                     in zip((other_api, client, other_api, client), calls_after(model_id, "after-move"))]
        results = [wait_future(client, res.json()["request_id"], timeout_s=300) for res in submitted]
        moved_after_s = time.monotonic() - started
        assert all("error" not in res for res in results), results
        new_home = _placed(s, [model_id])[model_id]
        assert new_home != home
        info = client.post("/get_info", json={"model_id": model_id}).json()
        assert info["status"] == "ready", info
        print(f"{home} frozen: its model answered from {new_home} {moved_after_s:.1f} s later "
              f"(QUILT_TRAINER_TAKEOVER_S={TAKEOVER_S})")
    finally:
        os.kill(pid, signal.SIGCONT)
    with pytest.raises(psycopg.OperationalError):
        held.execute("SELECT 1")  # ended by the shard that took over
    held.close()
    # Woken, the old shard finds it was fenced, exits, and the launcher starts it afresh.
    _until("the fenced shard to restart", lambda: f"trainer:{TINY}@{home} exited with 75"
           in (s.data_dir / "up.out").read_text(), timeout_s=60)
    _until("the restarted shard's beacon", lambda: (b := _beacon(r, home)) and b["pid"] != pid, timeout_s=120)

    assert_recovered(s.database_url, model_id, "after-move")
    # Every model the frozen shard held now lives on the other, idle ones included (restored
    # without waiting for a call); nothing of them is left on it.
    # (its first beacons carry no figures until its loop has run once)
    assert _until("the restarted shard's figures", lambda: (b := _beacon(r, home)) and "models" in b and b)[
        "models"] == 0
    with db.connect(s.database_url) as conn:
        conn.autocommit = True
        _until("every moved model to be ready", lambda: not conn.execute(
            "SELECT 1 FROM training_models WHERE status = 'recovering'").fetchall(), timeout_s=60)
        assert not conn.execute("SELECT 1 FROM training_models WHERE trainer_shard = %s AND status = 'ready'",
                                (home,)).fetchall()
    client.close()
    other_api.close()


def test_a_drained_shard_hands_its_models_over_intact(replicas_stack):
    s = replicas_stack
    _, key = new_tenant(s, "shard-drain")
    client = httpx.Client(base_url=s.base_url + "/api/v1", headers={"X-API-Key": key}, timeout=60)
    model_id = new_model(client, rank=4, seed=3)
    seq = 1
    for step in range(2):
        for body, route in ((fb_body(model_id, seq, [datum(SEQS[step])]), "/forward_backward"),
                            ({"model_id": model_id, "seq_id": seq + 1, "adam_params": ADAM}, "/optim_step")):
            assert "error" not in wait_future(client, client.post(route, json=body).json()["request_id"])
        seq += 2
    before = wait_future(client, client.post("/forward", json=fb_body(model_id, seq, [datum(SEQS[2])])).json()[
        "request_id"])
    home = _placed(s, [model_id])[model_id]

    drained = _quilt(s, "trainers", "drain", home, "--wait", "120")
    assert drained.returncode == 0, drained.stdout + drained.stderr
    assert "holds no models" in drained.stdout
    new_home = _placed(s, [model_id])[model_id]
    assert new_home != home
    after = wait_future(client, client.post("/forward", json=fb_body(model_id, seq + 1, [datum(SEQS[2])])).json()[
        "request_id"])
    assert after["metrics"]["loss:sum"] == pytest.approx(before["metrics"]["loss:sum"], rel=1e-6)

    # While it drains, new models go to the open shard; undrained, it takes them again.
    assert _placed(s, [new_model(client, rank=4, model_seq_id=1)]).popitem()[1] == new_home
    assert _quilt(s, "trainers", "undrain", home).returncode == 0
    bad = _quilt(s, "trainers", "drain", "shard-x")
    assert bad.returncode == 2 and "shard-<i>" in bad.stderr
    client.close()


def test_models_left_on_a_shard_past_the_count_are_re_placed(replicas_stack):
    """After the shard count is lowered, models placed on a shard that no longer runs are treated
    as a dead shard's: a live shard re-places them and fences the old name."""
    s = replicas_stack
    r = redis_client.sync_client(s.redis_url)
    tenant_id, key = new_tenant(s, "shard-stray")
    with httpx.Client(base_url=s.base_url + "/api/v1", headers={"X-API-Key": key}, timeout=60) as client:
        session_id = client.post("/create_session", json={}).json()["session_id"]
    model_id = f"{session_id}:train:9"
    with db.connect(s.database_url) as conn:
        conn.execute("INSERT INTO training_models (id, tenant_id, session_id, model_seq_id, base_model, lora_config, "
                     "status, trainer_shard) VALUES (%s, %s, %s, 9, %s, '{\"rank\": 4}', 'ready', 'shard-7')",
                     (model_id, tenant_id, session_id, TINY))
    placed = _until("the stray model to be re-placed",
                    lambda: (p := _placed(s, [model_id])[model_id]) != "shard-7" and p, timeout_s=60)
    assert placed in SHARDS
    assert r.exists(placement.fence_key(TINY, "shard-7"))
    # Its new shard restores it without waiting for a call; this one never had a snapshot, so it
    # is said to be lost rather than left recovering for ever.
    with db.connect(s.database_url) as conn:
        conn.autocommit = True
        _until("the stray model's fate", lambda: conn.execute(
            "SELECT status FROM training_models WHERE id = %s", (model_id,)).fetchone()["status"] == "lost")


def test_the_scaler_drains_a_shard_before_removing_it_and_routes_around_a_leaving_replica(replicas_stack, monkeypatch):
    """The capacity planner acting on Kubernetes (stack.k8s_scaler) against a local fake of the API
    server's scale subresource: a shard leaves only once the real shard has moved its models off;
    a generation replica taken out of service gets no new group and shows as leaving, not down;
    both come back when the planner asks. Runs last: it leaves the stack as it found it."""
    from k8sutil import FakeKubernetes

    from core.settings import ScalerSettings, clear_settings_cache
    from scaleout import in_service
    from scaleout.capacity_plan import Recommendation
    from stack import k8s_scaler

    s = replicas_stack
    monkeypatch.setenv("QUILT_GEN_REPLICAS", "2")
    monkeypatch.setenv("QUILT_TRAINER_SHARDS", "2")
    clear_settings_cache()
    r = redis_client.sync_client(s.redis_url)
    _, key = new_tenant(s, "scaler")
    client = quilt.Client(api_key=key, base_url=s.base_url)
    trainers = [client.create_training_client(TINY, rank=4, seed=i) for i in range(4)]
    models = [tc.model_id for tc in trainers]

    # As the cluster would run it after a scale-down: one generation pod (gen-1 is not in service).
    with FakeKubernetes({"quilt-gen": 1, "quilt-trainer": 2}) as fake, db.connect(s.database_url) as conn:
        conn.autocommit = True
        settings = ScalerSettings(act=True, api_server=fake.url, api_token="fake-token", namespace="quilt")
        cluster = k8s_scaler.StatefulSets(settings)
        wrong = k8s_scaler.StatefulSets(ScalerSettings(api_server=fake.url, api_token="nope", namespace="quilt"))
        with pytest.raises(Exception, match="401"):
            wrong.replicas("quilt-gen")
        merge = "application/merge-patch+json"

        def move(gen: int, train: int):
            return k8s_scaler.act(conn, r, cluster, settings, TINY, k8s_scaler.fleet_of(cluster, settings),
                                  Recommendation(gen, train, float(gen), "balance busy time"))

        def only_gen_0_samples(step: int) -> None:
            """Each model answers (a save on its shard), and its groups go to gen-0, never gen-1, even
            sent all at once, which the routers would otherwise spread over both."""
            time.sleep(0.5)  # past the routers' beacon refresh (gen_pool.router.REFRESH_S)
            params = quilt.SamplingParams(max_tokens=16, seed=1, stop=[])
            samplers = [tc.save_weights_and_get_sampling_client(f"scaled-{step}-{i}") for i, tc in enumerate(trainers)]
            futures = [sampler.sample([5, 6, 7], 16, params) for sampler in samplers for _ in range(2)]
            assert all(len(f.result(timeout=300).sequences) == 16 for f in futures)
            time.sleep(2.5)  # a beacon or two
            holders = {model_id: _holder(r, model_id) for model_id in models}
            assert all(h == ["gen-0"] for h in holders.values()), holders
            components = httpx.get(f"{s.base_url}/api/v1/healthz", timeout=10).json()["components"]
            assert components[f"gen:{TINY}@gen-1"]["leaving"] is True and components[f"gen:{TINY}@gen-0"]["ok"]

        # Trainers idle, generation full: a trainer device to generation. The shard is drained first;
        # neither count moves until it is empty, and generation waits for the device.
        assert placement.models_on(conn, TINY, "shard-1")  # the placement spread them
        first = move(2, 1)
        assert (first.gen, first.trainer, first.drain) == (1, 2, ("shard-1",)) and fake.patches == []
        assert placement.is_draining(conn, TINY, "shard-1")
        only_gen_0_samples(1)
        _until("shard-1 to hand its models over", lambda: not placement.models_on(conn, TINY, "shard-1"))
        second = move(2, 1)
        assert (second.gen, second.trainer) == (2, 1)
        assert fake.patches == [("quilt-trainer", 1, merge), ("quilt-gen", 2, merge)]  # the shrinking side first
        assert in_service.read(r, TINY).trainer == 1
        assert set(_placed(s, models).values()) == {"shard-0"}
        # Still beating (the fake starts and stops no pod): leaving, not down, and health is ok.
        healthz = httpx.get(f"{s.base_url}/api/v1/healthz", timeout=10)
        assert healthz.status_code == 200, healthz.text
        assert healthz.json()["components"][f"trainer:{TINY}@shard-1"]["leaving"] is True

        # Trainers full, generation idle: generation gives a replica back, the trainers take it in
        # the same tick and shard-1 (which the scaler drained) reopens.
        third = move(1, 2)
        assert (third.gen, third.trainer, third.reopen) == (1, 2, ("shard-1",))
        assert fake.patches[2:] == [("quilt-gen", 1, merge), ("quilt-trainer", 2, merge)]
        assert not placement.is_draining(conn, TINY, "shard-1")
        only_gen_0_samples(2)

        assert len(fake.patches) == 4
        # A whole tick reads the planner's inputs as the operator page does; what it recommends
        # depends on this stack's load, so only its consistency is checked.
        out = k8s_scaler.tick(conn, r, cluster, settings, db_url=s.database_url, redis_url=s.redis_url)
        assert out["base"] == TINY and (out["fleet"]["gen"], out["fleet"]["trainer"]) == (1, 2)
        if "action" in out:
            assert out["action"] == "no reading yet"
        else:
            assert in_service.read(r, TINY).reason == out["reason"]
            assert sum(out["recommended"]) == 3  # the devices in use now, moved, never added
        patched = len(fake.patches)

        # Off by default: the beat's task touches nothing.
        monkeypatch.delenv("QUILT_SCALER_ACT", raising=False)
        clear_settings_cache()
        assert k8s_scaler.tick_task() == {"action": "off"}
        assert len(fake.patches) == patched
        placement.set_draining(conn, TINY, "shard-1", False)  # in case the tick began a drain

    r.delete(in_service.key(TINY))
    clear_settings_cache()
    client.close()
