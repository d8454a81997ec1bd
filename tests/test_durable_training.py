"""A trainer killed with SIGKILL loses no step: its models come back from their snapshots, the
requests since (answered ones included) are replayed in seq_id order, queued ones run, and the
weights and AdamW state equal an uninterrupted run. Nothing is billed twice."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import psutil
import pytest
from durable_reference import SEQS, assert_recovered, calls_after, calls_before
from stackutil import TINY, datum, fb_body, new_model, wait_future

from core import db, queue, redis_client
from core.work import WorkItem
from stack import leftovers

pytestmark = pytest.mark.stack

def _kill_trainer(stack) -> int:
    return leftovers.kill_hard(stack.data_dir, f"trainer:{TINY}")


def _statuses_until_ready(stack, key: str, model_id: str, timeout_s: float = 300) -> list[str]:
    """get_info's status of `model_id`, each change, until it reads ready after something else."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    with stack.http(key) as client:
        while time.monotonic() < deadline:
            status = client.post("/get_info", json={"model_id": model_id}).json()["status"]
            if not seen or seen[-1] != status:
                seen.append(status)
            if status == "ready" and len(seen) > 1:
                return seen
            time.sleep(0.05)
    raise TimeoutError(f"{model_id} never ready again: {seen}")


def test_a_killed_trainer_resumes_every_model_at_its_last_step(stack, tenant):
    client = stack.http(tenant.key)
    model_id = new_model(client, rank=8, seed=0)
    bystander = new_model(client, rank=4, seed=1, model_seq_id=1)  # idle: it must survive too
    for route, body in calls_before(model_id):
        wait_future(client, client.post(route, json=body).json()["request_id"])
    # seq 3's gradients exist only in the trainer's memory now, and its answer has been given.
    _kill_trainer(stack)
    watcher = concurrent.futures.ThreadPoolExecutor(1).submit(_statuses_until_ready, stack, tenant.key, model_id)
    submitted = [client.post(route, json=body) for route, body in calls_after(model_id, "after-crash")]
    results = [wait_future(client, r.json()["request_id"], timeout_s=300) for r in submitted]
    assert all("error" not in r for r in results), results
    # As get_info tells it: recovering from the trainer's death (its heartbeat gone) until the
    # restarted trainer has replayed the model's log, then ready.
    seen = watcher.result(timeout=300)
    assert seen[-2:] == ["recovering", "ready"], seen
    r = client.post("/forward_backward", json=fb_body(bystander, 1, [datum(SEQS[0])]))
    assert "loss:sum" in wait_future(client, r.json()["request_id"])["metrics"]

    with db.connect(stack.database_url) as conn:
        statuses = {r["id"]: r["status"] for r in conn.execute(
            "SELECT id, status FROM training_models WHERE id = ANY(%s)", ([model_id, bystander],))}
    assert statuses == {model_id: "ready", bystander: "ready"}
    assert_recovered(stack.database_url, model_id, "after-crash")  # per tensor, to RELATIVE


def test_requests_queued_while_the_trainer_is_down_wait_and_run(stack, tenant):
    client = stack.http(tenant.key)
    model_id = new_model(client, rank=4, seed=0)
    _kill_trainer(stack)
    started = time.monotonic()
    r = client.post("/forward_backward", json=fb_body(model_id, 1, [datum(SEQS[0])]))
    result = wait_future(client, r.json()["request_id"], timeout_s=300)
    assert "loss:sum" in result["metrics"], result
    print(f"forward_backward across a trainer restart answered in {time.monotonic() - started:.1f} s")


def test_calls_left_in_shard_streams_run_once_the_shard_count_is_lowered_to_one(stack, tenant):
    """Going from several trainer shards back to one leaves the shards' streams behind: the one
    trainer moves their entries (queued calls, replay logs) into its own and runs them."""
    client = stack.http(tenant.key)
    model_id = new_model(client, rank=4, seed=0)
    trainer = leftovers.pid_of(stack.data_dir, f"trainer:{TINY}")
    launcher = psutil.Process(trainer).parent()
    stray, own = queue.train_stream(TINY, "shard-1"), queue.train_stream(TINY)
    r = redis_client.sync_client(stack.redis_url)
    # Stop the launcher first so the trainer stays down while its call is put where a shard left it.
    launcher.send_signal(signal.SIGSTOP)
    try:
        os.kill(trainer, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while psutil.pid_exists(trainer) and psutil.Process(trainer).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        submitted = client.post("/forward_backward", json=fb_body(model_id, 1, [datum(SEQS[0])])).json()
        (entry_id,) = [entry_id for entry_id, fields in r.xrange(own)
                       if WorkItem.from_fields(fields).request_id == submitted["request_id"]]
        assert queue.move(r, own, queue.TRAIN_GROUP, entry_id, stray)
        with db.connect(stack.database_url) as conn:
            conn.execute("UPDATE training_models SET trainer_shard = 'shard-1' WHERE id = %s", (model_id,))
    finally:
        launcher.send_signal(signal.SIGCONT)
    try:
        result = wait_future(client, submitted["request_id"], timeout_s=300)
        assert "loss:sum" in result["metrics"], result
        assert r.xlen(stray) == 0
    finally:
        with db.connect(stack.database_url) as conn:
            conn.execute("UPDATE training_models SET trainer_shard = NULL WHERE id = %s", (model_id,))
        r.close()
