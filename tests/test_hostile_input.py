"""One regression test per cause of a 5xx the hostile-client probe found (issue: no 5xx on any
input). Each answer is a 4xx naming the field (and the limit), or a failed future of category
user; the connection stays usable and the model keeps training."""

from __future__ import annotations

import gzip
import json

import httpx
import pytest
import zstandard
from stackutil import ADAM, TINY, datum, fb_body, new_model, wait_future

from api.input_guard import MAX_DEPTH


@pytest.fixture(scope="module")
def client(stack):
    return stack.http(stack.create_tenant("hostile").key)


@pytest.fixture(scope="module")
def session_id(client):
    return client.post("/create_session", json={}).json()["session_id"]


def _user_400(r: httpx.Response, field_part: str, *words: str) -> dict:
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["category"] == "user" and field_part in body["field"], body
    for w in words:
        assert w in body["error"], body
    return body


def _raw(client, path: str, text: str, **headers) -> httpx.Response:
    return client.post(path, content=text.encode(), headers={"content-type": "application/json", **headers})


# ----------------------------------------------------------------------------------- 1. text


@pytest.mark.parametrize("bad, what", [("\\u0000", "NUL"), ("\\ud800", "surrogate"), ("\\udfff", "surrogate")])
def test_nul_and_lone_surrogates_are_refused_wherever_they_are(client, session_id, bad, what):
    _user_400(_raw(client, "/create_session", '{"tags": ["a%sb"]}' % bad), "tags[0]", what)
    _user_400(_raw(client, "/create_session", '{"user_metadata": {"note": {"deep": "x%s"}}}' % bad),
              "user_metadata.note.deep", what)
    _user_400(_raw(client, "/create_session", '{"user_metadata": {"k%s": 1}}' % bad), "user_metadata", what)
    _user_400(_raw(client, "/session_heartbeat", '{"session_id": "s%s"}' % bad), "session_id", what)
    _user_400(_raw(client, "/create_model", json.dumps({
        "session_id": session_id, "model_seq_id": 0, "base_model": TINY, "lora_config": {"rank": 4}}).replace(
        TINY, TINY + bad)), "base_model", what)
    _user_400(_raw(client, "/forward_backward", json.dumps(fb_body("m", 1, [datum([1, 2, 3])])).replace(
        '"m"', '"m%s"' % bad)), "model_id", what)


def test_nul_in_path_and_query_parameters_is_refused(client):
    _user_400(client.get("/training_runs/run%00x"), "run_id", "NUL")
    _user_400(client.get("/samplers/s%00"), "sampling_session_id", "NUL")
    _user_400(client.get("/training_runs", params={"access_scope": "own\x00ed"}), "access_scope", "NUL")
    assert client.get("/training_runs").status_code == 200  # the same connection goes on


# --------------------------------------------------------------------------------- 2. numbers


def test_paging_past_what_postgres_holds_is_refused(client):
    for path in ("/training_runs", "/checkpoints"):
        _user_400(client.get(path, params={"offset": str(10**20)}), "offset")
        _user_400(client.get(path, params={"offset": "1e20"}), "offset")
        assert client.get(path, params={"offset": "5"}).status_code == 200


def test_a_lora_seed_past_int64_is_refused(client, session_id):
    r = client.post("/create_model", json={"session_id": session_id, "model_seq_id": 50, "base_model": TINY,
                                           "lora_config": {"rank": 4, "seed": 2**70}})
    _user_400(r, "lora_config.seed")


def test_integers_past_float64_are_refused_where_numbers_are_checked(client):
    model_id = new_model(client)
    _user_400(_raw(client, "/quilt/models/%s/metrics" % model_id,
                   '{"step": 1, "metrics": {"reward": 1%s}}' % ("0" * 400)), "metrics.reward")
    weights = json.dumps(fb_body(model_id, 1, [datum([1, 2, 3])])).replace("[1.0, 1.0]", "[1.0, 1%s]" % ("0" * 400))
    _user_400(_raw(client, "/forward_backward", weights), "weights", "float32")
    config = fb_body(model_id, 1, [datum([1, 2, 3])], loss_fn="ppo")
    config["forward_backward_input"]["data"][0]["loss_fn_inputs"].update(
        logprobs={"data": [-1.0, -1.0], "dtype": "float32"}, advantages={"data": [1.0, 1.0], "dtype": "float32"})
    text = json.dumps(config).replace('"ppo"', '"ppo", "loss_fn_config": {"clip_low_threshold": 1%s}' % ("0" * 400))
    _user_400(_raw(client, "/forward_backward", text), "loss_fn_config.clip_low_threshold", "magnitude")


def test_weights_that_overflow_float32_are_refused_at_the_edge(client):
    model_id = new_model(client)
    _user_400(client.post("/forward_backward", json=fb_body(model_id, 1, [datum([1, 2, 3], [1.0, 1e300])])),
              "data[0].loss_fn_inputs.weights", "float32", "position 1")
    _user_400(_raw(client, "/forward_backward", json.dumps(fb_body(model_id, 1, [datum([1, 2, 3])])).replace(
        "[1.0, 1.0]", "[1.0, 1e999]")), "weights.data[1]", "1e999", "not a finite number")


# ---------------------------------------------------- 6. results that overflow: a user failure


def test_a_loss_that_overflows_fails_its_future_as_user_and_the_model_goes_on(client):
    model_id = new_model(client)
    huge = 3e38  # within float32, but weight * logprob is not
    r = client.post("/forward_backward", json=fb_body(model_id, 1, [datum([1, 2, 3, 4], [huge] * 3)]))
    assert r.status_code == 200, r.text
    failed = wait_future(client, r.json()["request_id"])
    assert failed["category"] == "user" and "not finite" in failed["error"], failed
    step = client.post("/optim_step", json={"model_id": model_id, "seq_id": 2, "adam_params": ADAM})
    assert "error" not in wait_future(client, step.json()["request_id"])
    r = client.post("/forward_backward", json=fb_body(model_id, 3, [datum([1, 2, 3, 4])]))
    result = wait_future(client, r.json()["request_id"])
    assert result["metrics"]["loss:sum"] > 0, result


# ------------------------------------------------------------------- 3. structure and encodings


def test_json_nested_deeper_than_the_limit_is_refused(client):
    model_id = new_model(client)
    deep = "[" * 5000 + "]" * 5000  # refused before the parse: more arrays than such a body may hold
    text = json.dumps(fb_body(model_id, 1, [datum([1, 2, 3])])).replace(
        '"cross_entropy"', '"cross_entropy", "loss_fn_config": {"x": %s}' % deep)
    _user_400(_raw(client, "/forward_backward", text), "body", "objects and arrays")
    deep = "[" * 100 + "]" * 100  # within that bound: refused by its depth
    text = json.dumps(fb_body(model_id, 1, [datum([1, 2, 3])])).replace(
        '"cross_entropy"', '"cross_entropy", "loss_fn_config": {"x": %s}' % deep)
    _user_400(_raw(client, "/forward_backward", text), "loss_fn_config.x", str(MAX_DEPTH))
    _user_400(_raw(client, "/create_session", '{"user_metadata": {"a": %s}}' % ("[" * (MAX_DEPTH + 1) + "]" *
                                                                                 (MAX_DEPTH + 1))),
              "user_metadata.a", str(MAX_DEPTH))
    assert client.post("/create_session", json={"user_metadata": {"a": [[[1]]]}}).status_code == 200


def test_protobuf_token_bytes_that_are_not_whole_int32s_are_refused(client):
    from tinker.proto import tinker_public_pb2 as pb

    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    msg.data.add().model_input.add().encoded_text.tokens = b"\x01\x00\x00\x00\x02\x00"
    r = client.post("/forward_backward", content=msg.SerializeToString(),
                    headers={"content-type": "application/x-protobuf"})
    _user_400(r, "data[0].model_input", "6 bytes")


def test_a_non_ascii_csrf_token_on_the_login_form_is_refused_not_a_500(stack):
    with httpx.Client(base_url=stack.base_url) as browser:
        browser.get("/dashboard/login")
        r = browser.post("/dashboard/login", data={"api_key": "tml-x", "csrf_token": "é" * 10})
        assert r.status_code == 403, r.text


# ---------------------------------------------------------------------------- 4. body limits


def _limit(stack) -> int:
    from core.settings import get_api_settings

    return get_api_settings().max_body_bytes


def test_a_compressed_body_is_held_to_the_body_limit_while_it_is_decompressed(stack, client):
    limit = _limit(stack)
    bomb = b" " * (limit + 1)  # whitespace: valid JSON padding once inflated
    for encoding, packed in (("zstd", zstandard.ZstdCompressor().compress(bomb)), ("gzip", gzip.compress(bomb))):
        assert len(packed) < 100_000
        r = client.post("/create_session", content=packed,
                        headers={"content-type": "application/json", "content-encoding": encoding})
        assert r.status_code == 413, r.text
        assert r.json()["field"] == "body" and str(limit) in r.json()["error"] and "decompressed" in r.json()["error"]
    # Within the limit, a compressed JSON body is read as usual.
    small = zstandard.ZstdCompressor().compress(b'{"tags": ["zstd"]}')
    r = client.post("/create_session", content=small,
                    headers={"content-type": "application/json", "content-encoding": "zstd"})
    assert r.status_code == 200, r.text
    r = client.post("/create_session", content=b"{}", headers={"content-type": "application/json",
                                                               "content-encoding": "br"})
    assert r.status_code == 415 and r.json()["field"] == "content-encoding"
    r = client.post("/create_session", content=b"not zstd", headers={"content-type": "application/json",
                                                                     "content-encoding": "zstd"})
    assert r.status_code == 400 and "zstd" in r.json()["error"]


def test_a_chunked_body_over_the_limit_is_413_naming_the_limit(stack, client):
    limit = _limit(stack)

    def chunks():
        piece = b" " * 65536
        for _ in range(limit // len(piece) + 2):
            yield piece

    r = client.post("/create_session", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert str(limit) in r.json()["error"] and r.json()["field"] == "body"
