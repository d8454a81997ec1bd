"""TrainingClient.log_metrics: the body it posts, and the values it refuses before sending."""

import asyncio
import math

import pytest

ROUTE = "quilt/models/sess-1:train:0/metrics"


@pytest.fixture
def accept_metrics(server):
    server.routes[ROUTE] = lambda body: {"model_id": "sess-1:train:0", "step": body["step"] or 0,
                                         "recorded": len(body["metrics"])}
    return server


def _without_keys(bodies: list[dict]) -> list[dict]:
    return [{k: v for k, v in b.items() if k != "idempotency_key"} for b in bodies]


def test_posts_step_and_float_values(accept_metrics, tc):
    assert tc.log_metrics({"reward_mean": 0.5, "groups": 8}, step=3) is None
    assert _without_keys(accept_metrics.bodies(ROUTE)) == [{"step": 3, "metrics": {"reward_mean": 0.5, "groups": 8.0}}]


def test_a_retry_sends_the_same_idempotency_key(accept_metrics, tc):
    import httpx

    answers = [httpx.Response(503, json={"detail": "busy"}, headers={"Retry-After": "0"})]
    accept = accept_metrics.routes[ROUTE]
    accept_metrics.routes[ROUTE] = lambda body: answers.pop() if answers else accept(body)
    tc.log_metrics({"r": 1.0}, step=1)
    tc.log_metrics({"r": 2.0}, step=2)
    keys = [b["idempotency_key"] for b in accept_metrics.bodies(ROUTE)]
    assert len(keys) == 3 and keys[0] == keys[1] != keys[2]


def test_step_defaults_to_the_server_side_count(accept_metrics, tc):
    tc.log_metrics({"eval_acc": 1})
    assert accept_metrics.bodies(ROUTE)[0]["step"] is None


def test_async_form(accept_metrics, tc):
    asyncio.run(tc.log_metrics_async({"reward_mean": 0.25}, step=1))
    assert _without_keys(accept_metrics.bodies(ROUTE)) == [{"step": 1, "metrics": {"reward_mean": 0.25}}]


@pytest.mark.parametrize("metrics, step, error", [
    ({"r": math.nan}, 0, ValueError),
    ({"r": math.inf}, 0, ValueError),
    ({"r": "0.5"}, 0, TypeError),
    ({"r": True}, 0, TypeError),
    ({}, 0, TypeError),
    ({"r": 1.0}, -1, ValueError),
])
def test_bad_values_fail_before_sending(accept_metrics, tc, metrics, step, error):
    with pytest.raises(error):
        tc.log_metrics(metrics, step=step)
    assert accept_metrics.bodies(ROUTE) == []
