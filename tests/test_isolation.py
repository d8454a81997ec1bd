"""Tenant B can never see or touch tenant A's models, futures, sessions or checkpoints: all 404,
whether B calls with its API key or with an auth token minted from it (tenancy.tokens)."""

from __future__ import annotations

import pytest
from stackutil import ADAM, datum, fb_body, mint_token, new_model, wait_future


@pytest.fixture(scope="module")
def owned(stack):
    a = stack.create_tenant("a")
    ca = stack.http(a.key)
    session_id = ca.post("/create_session", json={}).json()["session_id"]
    model_id = new_model(ca, session_id=session_id)
    fut = ca.post("/forward_backward", json=fb_body(model_id, 1, [datum(list(range(3, 20)))])).json()
    wait_future(ca, fut["request_id"])
    save = ca.post("/save_weights", json={"model_id": model_id, "seq_id": 2, "path": "mine"}).json()
    path = wait_future(ca, save["request_id"])["path"]
    return {"session_id": session_id, "model_id": model_id, "request_id": fut["request_id"], "path": path}


@pytest.fixture(scope="module", params=["key", "token"])
def other(stack, request):
    key = stack.create_tenant("b").key
    return stack.http(key if request.param == "key" else mint_token(stack, key))


def test_get_info_of_another_tenants_model_is_404(owned, other):
    r = other.post("/get_info", json={"model_id": owned["model_id"]})
    assert r.status_code == 404
    assert r.json()["field"] == "model_id"


def test_training_another_tenants_model_is_404(owned, other):
    assert other.post("/forward_backward", json=fb_body(owned["model_id"], 3, [datum([1, 2, 3])])).status_code == 404
    assert other.post("/optim_step", json={"model_id": owned["model_id"], "seq_id": 3, "adam_params": ADAM}).status_code == 404
    assert other.post("/save_weights", json={"model_id": owned["model_id"], "seq_id": 3, "path": "x"}).status_code == 404


def test_another_tenants_future_is_404(owned, other):
    r = other.post("/retrieve_future", json={"request_id": owned["request_id"]})
    assert r.status_code == 404
    assert r.json()["field"] == "request_id"


def test_another_tenants_session_is_404(owned, other):
    assert other.post("/session_heartbeat", json={"session_id": owned["session_id"]}).status_code == 404
    r = other.post("/create_model", json={"session_id": owned["session_id"], "model_seq_id": 5,
                                          "base_model": "quilt/tiny-qwen3", "lora_config": {"rank": 4}})
    assert r.status_code == 404


def test_another_tenants_checkpoint_is_404(owned, other):
    mine = new_model(other)
    r = other.post("/load_weights", json={"model_id": mine, "seq_id": 1, "path": owned["path"], "optimizer": True})
    assert r.status_code == 404
    assert r.json()["field"] == "path"
