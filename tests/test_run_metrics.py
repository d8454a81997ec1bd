"""Per-step run metrics on the real stack: the trainer's row per forward_backward, client posts,
their validation, and tenant scoping."""

from __future__ import annotations

import math
import time

import pytest
from stackutil import ADAM, datum, fb_body, new_model, wait_future


def _metrics_url(model_id: str) -> str:
    return f"/quilt/models/{model_id}/metrics"


def _trainer_rows(client, model_id: str, n: int, timeout_s: float = 30) -> list[dict]:
    """The model's trainer rows once there are `n`: a worker answers the future (Redis) just before
    it commits the request's rows (Postgres), so the last one may trail the result briefly."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = [r for r in client.get(_metrics_url(model_id)).json()["metrics"] if r["source"] == "trainer"]
        if len(rows) >= n or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


@pytest.fixture(scope="module")
def trained(stack):
    """A model with: forward_backward (step 0), optim_step, forward_backward with sampler version 0 (step 1)."""
    owner = stack.create_tenant("rm")
    client = stack.http(owner.key)
    model_id = new_model(client)
    weights = [0.0, 0.0] + [1.0] * 14
    for _seq, body in enumerate([
        fb_body(model_id, 1, [datum(list(range(10, 27)), weights)]),
        {"model_id": model_id, "seq_id": 2, "adam_params": ADAM},
        fb_body(model_id, 3, [datum(list(range(10, 27)), weights)], loss_fn_config={"policy_version": 0}),
    ], start=1):
        route = "/optim_step" if "adam_params" in body else "/forward_backward"
        result = wait_future(client, client.post(route, json=body).json()["request_id"])
        assert "error" not in result, result
    return owner, client, model_id


def test_trainer_writes_one_row_per_forward_backward_at_its_policy_version(trained):
    _, client, model_id = trained
    trainer = _trainer_rows(client, model_id, 2)
    assert [r["step"] for r in trainer] == [0, 1]
    first = trainer[0]["metrics"]
    assert math.isclose(first["loss:mean"], first["loss:sum"] / 14, rel_tol=1e-9)  # 14 weighted tokens
    assert trainer[1]["metrics"]["staleness:mean"] == 1.0  # sampled at version 0, trained at 1


def test_client_metrics_are_stored_with_their_step_or_the_models_step(trained):
    _, client, model_id = trained
    r = client.post(_metrics_url(model_id), json={"step": 7, "metrics": {"reward_mean": 0.25}})
    assert r.status_code == 200 and r.json() == {"model_id": model_id, "step": 7, "recorded": 1}
    r = client.post(_metrics_url(model_id), json={"metrics": {"eval_acc": 1}})
    assert r.json()["step"] == 1  # one optimizer step completed
    client_rows = [r for r in client.get(_metrics_url(model_id)).json()["metrics"] if r["source"] == "client"]
    assert [(r["step"], r["metrics"]) for r in client_rows] == [(1, {"eval_acc": 1.0}), (7, {"reward_mean": 0.25})]


def test_a_repeated_idempotency_key_records_nothing_new(stack):
    client = stack.http(stack.create_tenant("idem").key)
    model_id = new_model(client)
    body = {"step": 3, "metrics": {"reward_mean": 0.5}, "idempotency_key": "log-0001"}
    for _ in range(3):  # the first call and two retries
        r = client.post(_metrics_url(model_id), json=body)
        assert r.status_code == 200 and r.json()["step"] == 3, r.text
    r = client.post(_metrics_url(model_id), json={**body, "idempotency_key": "log-0002"})
    assert r.status_code == 200
    rows = [r for r in client.get(_metrics_url(model_id)).json()["metrics"] if r["source"] == "client"]
    assert len(rows) == 2
    r = client.post(_metrics_url(model_id), json={**body, "idempotency_key": "no spaces!"})
    assert r.status_code == 400 and r.json()["field"] == "idempotency_key"


@pytest.mark.parametrize("body, field", [
    ({"step": 1, "metrics": {f"m{i}": 1.0 for i in range(65)}}, "metrics"),
    ({"step": 1, "metrics": {"r": "high"}}, "metrics.r"),
    ({"step": -1, "metrics": {"r": 1.0}}, "step"),
    ({"step": 1}, "metrics"),
    ({"step": 1, "metrics": {"r": 1.0}, "extra": 1}, "extra"),
])
def test_bad_posts_are_400_naming_the_field(trained, body, field):
    _, client, model_id = trained
    r = client.post(_metrics_url(model_id), json=body)
    assert r.status_code == 400 and r.json()["field"] == field, r.text


def test_non_finite_values_are_400(trained):
    _, client, model_id = trained
    r = client.post(_metrics_url(model_id), content=b'{"step": 1, "metrics": {"r": NaN}}',
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["field"] == "metrics.r"


def test_another_tenants_model_is_404_both_ways(stack, trained):
    _, _, model_id = trained
    other = stack.http(stack.create_tenant("rm-other").key)
    assert other.get(_metrics_url(model_id)).status_code == 404
    r = other.post(_metrics_url(model_id), json={"step": 0, "metrics": {"r": 1.0}})
    assert r.status_code == 404 and r.json()["field"] == "model_id"


def test_sdk_log_metrics_round_trip(stack, tenant):
    with stack.sdk(tenant.key) as client:
        tc = client.create_training_client("quilt/tiny-qwen3", rank=4, seed=0)
        tc.log_metrics({"reward_mean": 0.5, "reward_std": 0.1}, step=2)
        rows = stack.http(tenant.key).get(_metrics_url(tc.model_id)).json()["metrics"]
    assert rows[0]["step"] == 2 and rows[0]["metrics"] == {"reward_mean": 0.5, "reward_std": 0.1}
