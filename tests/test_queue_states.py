"""Queue states through the official tinker SDK (issue 62 item 7): a tenant over its in-flight and
tokens-per-minute limits is not refused; its calls wait as `paused_rate_limit`, its client's
`on_queue_state_change` hears why and then `active`, every result arrives in order, each call is
billed once, and another tenant's calls never wait meanwhile."""

from __future__ import annotations

import threading

import pytest

tinker = pytest.importorskip("tinker")
from stackutil import datum, fb_body, new_model, wait_future  # noqa: E402
from tinker import types  # noqa: E402
from tinker.lib.api_future_impl import QueueState, QueueStateObserver  # noqa: E402
from tinkerutil import ready  # noqa: E402

from core import db  # noqa: E402
from tenancy.tenants import set_quota  # noqa: E402

TINY = "quilt/tiny-qwen3"
TPM = 1000
CALLS = 12  # of 100 tokens each: the bucket holds 10, the last two wait for it whatever the timing


class Recorder(QueueStateObserver):
    """Every queue state the SDK reports, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[QueueState, str | None]] = []
        self._lock = threading.Lock()

    def on_queue_state_change(self, queue_state: QueueState, queue_state_reason: str | None) -> None:
        with self._lock:
            self.seen.append((queue_state, queue_state_reason))


def test_the_try_again_answer_is_the_sdks_wire_shape():
    """A waiting future's answer parses as the SDK's own TryAgainResponse, for each queue state."""
    from tinker.types.try_again_response import TryAgainResponse

    from api import queue_states
    from api.admission_rule import CAPACITY, RATE

    for state in (RATE, CAPACITY):
        body = queue_states.try_again({"id": "req-1", "queue_state": state, "queue_reason": "why"})
        parsed = TryAgainResponse.model_validate(body)
        assert parsed.queue_state == state and parsed.request_id == "req-1"
        assert body["queue_state_reason"] == "why"


def _data(i: int) -> list:
    toks = list(range(10 + i, 10 + i + 101))  # 100 model-input tokens
    return [types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                        loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 100})]


def test_a_tenant_over_its_limits_waits_in_queue_states_and_loses_nothing(stack, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    slow, calm = stack.create_tenant("qs-slow"), stack.create_tenant("qs-calm")
    with db.connect(stack.database_url) as conn:
        set_quota(conn, slow.name, tokens_per_minute=TPM, max_inflight_requests=2)
    c = stack.http(calm.key)
    calm_model = new_model(c)

    with tinker.ServiceClient(base_url=stack.base_url, api_key=slow.key) as service:
        tc = ready(service.create_lora_training_client(base_model=TINY, rank=4))
        recorder = Recorder()
        tc._queue_state_logger = recorder  # the observer the training client hands each of its futures
        futures = [tc.forward_backward(_data(i), "cross_entropy") for i in range(CALLS)]

        # Meanwhile another tenant is admitted and answered as ever: its calls never wait.
        calm_calls = [c.post("/forward_backward", json=fb_body(calm_model, seq, [datum([1, 2, 3, 4])]))
                      for seq in (1, 2, 3)]
        assert [r.status_code for r in calm_calls] == [200] * 3, [r.text for r in calm_calls]
        for r in calm_calls:
            assert "loss:sum" in wait_future(c, r.json()["request_id"])["metrics"]

        outs = [f.result(timeout=300) for f in futures]
        assert all("loss:sum" in o.metrics for o in outs)
        model_id = tc.model_id

    states = [s for s, _ in recorder.seen]
    assert QueueState.PAUSED_RATE_LIMIT in states, recorder.seen
    first_pause = states.index(QueueState.PAUSED_RATE_LIMIT)
    assert QueueState.ACTIVE in states[first_pause:] and states[-1] is QueueState.ACTIVE, recorder.seen
    reasons = {r for s, r in recorder.seen if s is QueueState.PAUSED_RATE_LIMIT}
    assert any("tokens_per_minute" in r or "max_inflight_requests" in r or "ahead of this one" in r
               for r in reasons if r), reasons

    with db.connect(stack.database_url) as conn:
        rows = conn.execute("SELECT id, seq_id, status, queue_state, started_at FROM requests "
                            "WHERE model_id = %s AND kind = 'forward_backward' ORDER BY seq_id", (model_id,)).fetchall()
        open_rows = conn.execute("SELECT count(*) AS n FROM requests WHERE tenant_id = %s AND status NOT IN "
                                 "('done', 'failed')", (slow.tenant_id,)).fetchone()["n"]
        billed = conn.execute("SELECT count(*) AS n, count(DISTINCT request_id) AS d FROM usage_ledger "
                              "WHERE request_id = ANY(%s)", ([r["id"] for r in rows],)).fetchone()
        calm_waited = conn.execute("SELECT count(*) AS n FROM requests WHERE tenant_id = %s AND queue_state IS NOT NULL",
                                   (calm.tenant_id,)).fetchone()["n"]
    assert len(rows) == CALLS and all(r["status"] == "done" for r in rows), rows
    assert any(r["queue_state"] == "paused_rate_limit" for r in rows)  # some really waited
    # They ran in seq_id order: each started no sooner than the one before it.
    starts = [r["started_at"] for r in rows]
    assert starts == sorted(starts), starts
    assert open_rows == 0  # nothing left paused or in flight: the quota is free again
    assert billed["n"] == CALLS and billed["d"] == CALLS  # each billed exactly once
    assert calm_waited == 0


def test_a_call_waiting_past_its_deadline_fails_in_its_place_and_the_model_goes_on(stack, tmp_path):
    """On an API whose QUILT_QUEUE_WAIT_DEADLINE_S is 3 s, a call the bucket holds back for about
    12 s fails clearly at its seq_id (billed nothing), and the model's next call runs."""
    import httpx
    from stackutil import second_api

    tenant = stack.create_tenant("qs-deadline")
    with db.connect(stack.database_url) as conn:
        set_quota(conn, tenant.name, tokens_per_minute=TPM)
    with second_api(stack, tmp_path, QUILT_QUEUE_WAIT_DEADLINE_S="3") as url, \
            httpx.Client(base_url=url + "/api/v1", headers={"X-API-Key": tenant.key}, timeout=60) as client:
        model_id = new_model(client)
        big = [datum(list(range(1, 102)))] * 3  # 300 model-input tokens
        calls = [client.post("/forward_backward", json=fb_body(model_id, seq, big)) for seq in (1, 2, 3, 4)]
        assert [r.status_code for r in calls] == [200] * 4, [r.text for r in calls]
        late = calls[3].json()["request_id"]
        failed = wait_future(client, late)
        assert failed["category"] == "user" and "QUILT_QUEUE_WAIT_DEADLINE_S" in failed["error"], failed
        assert "paused_rate_limit" in failed["error"] and "tokens_per_minute" in failed["error"]
        for r in calls[:3]:
            assert "loss:sum" in wait_future(client, r.json()["request_id"])["metrics"]
        after = client.post("/forward_backward", json=fb_body(model_id, 5, [datum([1, 2, 3])]))
        assert "loss:sum" in wait_future(client, after.json()["request_id"])["metrics"]
    with db.connect(stack.database_url) as conn:
        billed = conn.execute("SELECT count(*) AS n FROM usage_ledger WHERE request_id = %s", (late,)).fetchone()["n"]
        row = conn.execute("SELECT status, queue_state FROM requests WHERE id = %s", (late,)).fetchone()
    assert billed == 0 and row["status"] == "failed" and row["queue_state"] == "paused_rate_limit"
