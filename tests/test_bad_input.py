"""Bad input gets a 4xx naming the field and the limit (or a failed future of category user for
checks only the worker can make); the worker stays up and other tenants are untouched."""

from __future__ import annotations

import json

import pytest
from stackutil import ADAM, datum, fb_body, new_model, wait_future

VOCAB = 1024  # the tiny model's


@pytest.fixture(scope="module")
def client(stack):
    return stack.http(stack.create_tenant("bad").key)


@pytest.fixture(scope="module")
def model_id(client):
    return new_model(client)


def _post_fb(client, body):
    return client.post("/forward_backward", content=json.dumps(body), headers={"Content-Type": "application/json"})


def _assert_400(r, field_part: str, *words: str):
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["category"] == "user" and body["request_id"]
    assert field_part in body["field"], body
    for w in words:
        assert w in body["detail"], body


def test_token_outside_vocabulary(client, model_id):
    r = _post_fb(client, fb_body(model_id, 1, [datum([1, 2, VOCAB + 5])]))
    _assert_400(r, "data[0].loss_fn_inputs.target_tokens", str(VOCAB + 5), f"[0, {VOCAB})")
    r = _post_fb(client, fb_body(model_id, 1, [datum([-1, 2, 3])]))
    _assert_400(r, "data[0].model_input", "-1", "vocabulary")


def test_inputs_of_different_length(client, model_id):
    d = datum(list(range(1, 10)))
    d["loss_fn_inputs"]["weights"] = {"data": [1.0] * 3, "dtype": "float32", "shape": [3]}
    _assert_400(_post_fb(client, fb_body(model_id, 1, [d])), "data[0].loss_fn_inputs.weights", "3 values", "8 tokens")


def test_empty_data(client, model_id):
    _assert_400(_post_fb(client, fb_body(model_id, 1, [])), "data", "at least one datum")


def test_non_finite_weights(client, model_id):
    d = datum(list(range(1, 6)))
    d["loss_fn_inputs"]["weights"]["data"][1] = float("nan")
    _assert_400(_post_fb(client, fb_body(model_id, 1, [d])), "weights", "finite")
    d["loss_fn_inputs"]["weights"]["data"][1] = float("inf")
    _assert_400(_post_fb(client, fb_body(model_id, 1, [d])), "weights", "finite")


def test_unknown_loss_fn(client, model_id):
    _assert_400(_post_fb(client, fb_body(model_id, 1, [datum([1, 2, 3])], loss_fn="mystery")),
                "loss_fn", "mystery", "cross_entropy")


def test_missing_loss_input(client, model_id):
    _assert_400(_post_fb(client, fb_body(model_id, 1, [datum([1, 2, 3])], loss_fn="ppo")),
                "loss_fn_inputs", "advantages")


def test_unknown_model_is_404(client):
    r = _post_fb(client, fb_body("sess-nope:train:0", 1, [datum([1, 2, 3])]))
    assert r.status_code == 404 and r.json()["field"] == "model_id"


def test_bad_adam_params(client, model_id):
    r = client.post("/optim_step", json={"model_id": model_id, "seq_id": 1, "adam_params": {**ADAM, "beta1": 1.5}})
    _assert_400(r, "adam_params.beta1", "less than 1")


def test_another_optimizers_params_are_refused_by_name(client, model_id):
    # What tinker 0.38 sends for DimuonParams (optimizer_params in place of adam_params), to a model
    # created with AdamW: the family is the model's for its life.
    r = client.post("/optim_step", json={"model_id": model_id, "seq_id": 1,
                                         "optimizer_params": {"type": "dimuon", "learning_rate": 0.02}})
    _assert_400(r, "optimizer_params", "AdamW", "send adam_params")


def test_rank_over_the_limit(client):
    session_id = client.post("/create_session", json={}).json()["session_id"]
    r = client.post("/create_model", json={"session_id": session_id, "model_seq_id": 0,
                                           "base_model": "quilt/tiny-qwen3", "lora_config": {"rank": 10_000}})
    _assert_400(r, "lora_config.rank", "512")


def test_unknown_base_model_names_the_served_ones(client):
    session_id = client.post("/create_session", json={}).json()["session_id"]
    r = client.post("/create_model", json={"session_id": session_id, "model_seq_id": 0,
                                           "base_model": "acme/giant", "lora_config": {"rank": 4}})
    assert r.status_code == 404
    assert "quilt/tiny-qwen3" in r.json()["detail"]


def test_payload_over_the_size_limit_is_413(client, model_id):
    big = b'{"pad": "' + b"x" * (17 * 1024 * 1024) + b'"}'
    r = client.post("/forward_backward", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert "limit" in r.json()["detail"] and r.json()["field"] == "body"


def test_a_bad_loss_config_is_refused_at_the_edge_and_others_continue(stack, client):
    # A model of its own: the refusals above used up seq_id 1 of the shared one (api.seq_gaps).
    model_id = new_model(client)
    bad = client.post("/forward_backward", json=fb_body(model_id, 1, [datum([1, 2, 3])],
                                                         loss_fn_config={"no_such_knob": 1.0}))
    assert bad.status_code == 400, bad.text
    assert bad.json()["field"] == "loss_fn_config.no_such_knob" and "allowed keys" in bad.json()["error"]
    # The same model continues, and so does another tenant.
    ok = client.post("/forward_backward", json=fb_body(model_id, 2, [datum([1, 2, 3])])).json()
    assert "loss:sum" in wait_future(client, ok["request_id"])["metrics"]
    other = stack.http(stack.create_tenant("bystander").key)
    other_model = new_model(other)
    r = other.post("/forward_backward", json=fb_body(other_model, 1, [datum([4, 5, 6])])).json()
    assert "loss:sum" in wait_future(other, r["request_id"])["metrics"]


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_prompt_token_is_a_400_not_a_500(client, token):
    body = ('{"base_model": "quilt/tiny-qwen3", "num_samples": 1, "sampling_params": {"max_tokens": 2}, '
            '"prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, %s]}]}}' % token)
    r = client.post("/asample", content=body, headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, r.text
    assert r.status_code == 400 and r.json()["field"].startswith("prompt"), r.text
