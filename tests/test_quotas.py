"""Quotas against the real stack: tokens per minute (a Redis token bucket shared by API
replicas, changed with `quilt tenants set-quota`) and the deadline for requests that wait on a
seq_id that never comes. A training call on an existing model over the rate or in-flight limits
is not refused: it waits in a queue state (api.queue_states; through the tinker SDK in
tests/test_queue_states.py); sampling calls are still refused with 429."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from stackutil import TINY, datum, fb_body, new_model, wait_future

from core import db

pytestmark = pytest.mark.stack

LIMIT = 1000


def _set_quota(stack, name: str, *args: str) -> str:
    env = {**os.environ, "QUILT_DATABASE_URL": stack.database_url, "QUILT_REDIS_URL": stack.redis_url,
           "QUILT_DATA_DIR": str(stack.data_dir)}
    out = subprocess.run([sys.executable, "-m", "stack.cli", "tenants", "set-quota", name, *args], env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _fb(client, model_id: str, seq_id: int, n_datums: int = 3):
    # Each datum: 100 model-input tokens.
    return client.post("/forward_backward", json=fb_body(model_id, seq_id, [datum(list(range(1, 102)))] * n_datums))


def _paused(client, request_id: str) -> dict:
    """The future of a call waiting in a queue state: `try_again` naming the state and why."""
    r = client.post("/retrieve_future", json={"request_id": request_id})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["type"] == "try_again" and body["queue_state"] == "paused_rate_limit", body
    return body


def test_a_flooding_tenant_waits_on_tokens_per_minute_and_another_tenant_is_not_affected(stack):
    flood, calm = stack.create_tenant("flood"), stack.create_tenant("calm")
    assert f"tokens_per_minute={LIMIT}" in _set_quota(stack, flood.name, "--tokens-per-minute", str(LIMIT),
                                                      "--max-inflight", "64")
    f, c = stack.http(flood.key), stack.http(calm.key)
    f_model, c_model = new_model(f), new_model(c)

    accepted = [_fb(f, f_model, seq) for seq in (1, 2, 3)]  # 900 of the 1,000 tokens
    assert all(r.status_code == 200 for r in accepted), [r.text for r in accepted]
    waiting = _fb(f, f_model, 4)  # accepted, and waits for the bucket
    assert waiting.status_code == 200, waiting.text
    reason = _paused(f, waiting.json()["request_id"])["queue_state_reason"]
    assert "tokens_per_minute" in reason and str(LIMIT) in reason
    # Sampling counts too (prompt + max_tokens per sample), and is still refused: it has no seq_id
    # to hold its place.
    s = f.post("/asample", json={"base_model": TINY, "num_samples": 4, "prompt": {"chunks": [
        {"type": "encoded_text", "tokens": [1, 2, 3]}]}, "sampling_params": {"max_tokens": 40}})
    assert s.status_code == 429 and s.json()["field"] == "tokens_per_minute", s.text

    # The other tenant's calls pass while the flood is refused.
    for seq in (1, 2, 3, 4, 5):
        r = _fb(c, c_model, seq)
        assert r.status_code == 200, r.text
    assert "loss:sum" in wait_future(c, r.json()["request_id"])["metrics"]

    # One call bigger than a minute's worth can never pass: it is told to split at once (and uses up
    # its seq_id, as any refusal for good does: its placeholder waits behind seq 4, so the trainer
    # never sees seq 5 before 4).
    big = _fb(f, f_model, 5, n_datums=11)
    assert big.status_code == 400 and "split" in big.json()["error"], big.text  # retrying cannot help
    # The waiting call runs once the bucket has refilled, then the placeholder fails in its place.
    assert "loss:sum" in wait_future(f, waiting.json()["request_id"])["metrics"]
    retry = _fb(f, f_model, 4)  # a retry of the call admitted before: the same future
    assert retry.json()["request_id"] == waiting.json()["request_id"]


def test_requests_behind_a_seq_id_that_never_comes_fail_after_the_deadline_and_free_the_quota(stack, tenant):
    deadline_s = float(os.environ.get("QUILT_TRAINER_SEQ_GAP_DEADLINE_S", "20"))
    client = stack.http(tenant.key)
    model_id = new_model(client)
    waiting = [client.post("/forward_backward", json=fb_body(model_id, seq, [datum([1, 2, 3])])) for seq in (2, 3)]
    started = time.monotonic()
    for r in waiting:
        failed = wait_future(client, r.json()["request_id"], timeout_s=deadline_s + 120)
        assert failed["category"] == "user" and "seq_id 1 " in failed["error"] and "never arrived" in failed["error"]
    assert time.monotonic() - started >= deadline_s - 5
    with db.connect(stack.database_url) as conn:
        open_rows = conn.execute("SELECT count(*) AS n FROM requests WHERE model_id = %s AND status NOT IN "
                                 "('done', 'failed')", (model_id,)).fetchone()["n"]
    assert open_rows == 0  # no longer in flight
    # The model goes on after them; the missing seq_id, sent now, is refused as late.
    r = client.post("/forward_backward", json=fb_body(model_id, 4, [datum([1, 2, 3])]))
    assert "loss:sum" in wait_future(client, r.json()["request_id"])["metrics"]
    late = client.post("/forward_backward", json=fb_body(model_id, 1, [datum([1, 2, 3])]))
    failed = wait_future(client, late.json()["request_id"])
    assert failed["category"] == "user" and "arrived after" in failed["error"], failed


def test_the_inflight_quota_holds_a_call_on_a_model_waiting_until_work_finishes(stack):
    """Admission reads the in-flight count with the model (one statement): the limit still holds
    (the call past it waits in a queue state naming the limit), spares other tenants, and lifts as
    the tenant's work finishes."""
    busy, calm = stack.create_tenant("busy"), stack.create_tenant("calm-inflight")
    b, c = stack.http(busy.key), stack.http(calm.key)
    b_model, c_model = new_model(b), new_model(c)
    assert "max_inflight_requests=3" in _set_quota(stack, busy.name, "--max-inflight", "3")
    # seq 2-4 wait in the trainer for seq 1, so they stay in flight.
    waiting = [_fb(b, b_model, seq, n_datums=1) for seq in (2, 3, 4)]
    assert all(r.status_code == 200 for r in waiting), [r.text for r in waiting]
    held = _fb(b, b_model, 5, n_datums=1)
    assert held.status_code == 200, held.text
    reason = _paused(b, held.json()["request_id"])["queue_state_reason"]
    assert "max_inflight_requests" in reason and "limit of 3" in reason
    assert _fb(c, c_model, 1, n_datums=1).status_code == 200  # another tenant is not affected
    # The limit counts every unfinished request, the ones waiting for seq 1 too: a client sending
    # out of order past its limit waits behind them (or their seq-gap deadline).
    first = _fb(b, b_model, 1, n_datums=1)
    assert first.status_code == 200, first.text
    _paused(b, first.json()["request_id"])
    _set_quota(stack, busy.name, "--max-inflight", "5")
    # The polls promote seq 1 before seq 5 (a model's calls go in seq_id order), and all run.
    for r in [first, *waiting, held]:
        assert "loss:sum" in wait_future(b, r.json()["request_id"])["metrics"]
    assert _fb(b, b_model, 6, n_datums=1).status_code == 200  # finished work frees the quota


def _bucket_level(stack, tenant_id: str) -> float:
    """What the tenant's tokens-per-minute bucket holds now (tenancy.rate_limit's own refill rule)."""
    import redis

    from tenancy import rate_limit

    with redis.Redis.from_url(stack.redis_url) as r:
        tokens, at = r.hmget(rate_limit.bucket_key(tenant_id), "tokens", "at")
        seconds, micros = r.time()
    if tokens is None:
        return float(LIMIT)
    return min(LIMIT, float(tokens) + max(0.0, seconds + micros / 1e6 - float(at)) * LIMIT / 60)


def test_refused_calls_and_retries_take_no_tokens(stack):
    """Tokens are taken when a call's entry is appended (admission): a call refused before that
    (not your model, bad tokens), one waiting in a queue state (the in-flight quota) or a retry of a
    call admitted before takes nothing, and an admitted call takes its tokens once."""
    t, other = stack.create_tenant("refund"), stack.create_tenant("refund-other")
    _set_quota(stack, t.name, "--tokens-per-minute", str(LIMIT), "--max-inflight", "3")
    c, o = stack.http(t.key), stack.http(other.key)
    model, others_model = new_model(c), new_model(o)
    full = _bucket_level(stack, t.tenant_id)

    first = _fb(c, model, 2)  # waits for seq 1: stays in flight
    assert first.status_code == 200, first.text
    after_one = _bucket_level(stack, t.tenant_id)
    assert full - 300 - 1 <= after_one <= full - 300 + 30  # taken once (plus a few seconds' refill at most)

    for _ in range(3):  # retries of an admitted call: the same future, nothing taken again
        again = _fb(c, model, 2)
        assert again.status_code == 200 and again.json()["request_id"] == first.json()["request_id"]
    bad_token = [datum([1] * 100 + [10**6] + [1] * 100)]  # 200 model-input tokens, one outside the vocabulary
    calls = [
        (_fb(c, others_model, 1), 404),  # another tenant's model: not found
        (_fb(c, others_model, 2), 404),
        (c.post("/forward_backward", json=fb_body(model, 3, bad_token)), 400),  # uses up seq 3: in flight
        (_fb(c, model, 4), 200),  # in flight: 3 of 3
        (_fb(c, model, 5), 200),  # past the in-flight quota: waits
    ]
    for r, status in calls:
        assert r.status_code == status, r.text
    assert "max_inflight_requests" in _paused(c, calls[-1][0].json()["request_id"])["queue_state_reason"]
    # Only seq 4 took tokens since: none of the refused calls, retries or waiting calls took any.
    assert _bucket_level(stack, t.tenant_id) >= after_one - 300 - 1

    _set_quota(stack, t.name, "--max-inflight", "64")
    done = _fb(c, model, 1)
    assert done.status_code == 200, done.text
    for r in (done, first, calls[3][0], calls[4][0]):
        assert "loss:sum" in wait_future(c, r.json()["request_id"])["metrics"]
