"""A model's requests run in seq_id order whatever order they arrive in; repeats are de-duplicated."""

from __future__ import annotations

from stackutil import ADAM, datum, fb_body, new_model, wait_future

TOKENS = list(range(10, 40))


def _sequence(model_id: str) -> list[tuple[int, str, dict]]:
    return [
        (1, "/forward_backward", fb_body(model_id, 1, [datum(TOKENS)])),
        (2, "/optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": ADAM}),
        (3, "/forward", fb_body(model_id, 3, [datum(TOKENS)])),
        (4, "/forward_backward", fb_body(model_id, 4, [datum(TOKENS)])),
    ]


def _losses(client, ids) -> list[float]:
    return [wait_future(client, rid)["metrics"]["loss:sum"] for rid in ids]


def test_out_of_order_arrival_gives_the_in_order_result(stack, tenant):
    client = stack.http(tenant.key)
    in_order = new_model(client, seed=7)
    shuffled = new_model(client, seed=7)  # same seed: identical initial adapters

    expected_ids = {seq: client.post(path, json=body).json()["request_id"] for seq, path, body in _sequence(in_order)}
    arrived = {}
    for seq, path, body in reversed(_sequence(shuffled)):  # 4, 3, 2, 1
        arrived[seq] = client.post(path, json=body).json()["request_id"]

    expected = _losses(client, [expected_ids[s] for s in (1, 3, 4)])
    got = _losses(client, [arrived[s] for s in (1, 3, 4)])
    assert got == expected
    # The optimizer step in between really happened before seq 3 (the loss moved).
    assert expected[1] < expected[0]


def test_repeated_seq_id_returns_the_existing_future(stack, tenant):
    client = stack.http(tenant.key)
    model_id = new_model(client)
    body = fb_body(model_id, 1, [datum(TOKENS)])
    first = client.post("/forward_backward", json=body).json()
    again = client.post("/forward_backward", json=body).json()
    assert again["request_id"] == first["request_id"]
    assert "loss:sum" in wait_future(client, first["request_id"])["metrics"]


def test_seq_id_reused_by_a_different_kind_is_rejected(stack, tenant):
    client = stack.http(tenant.key)
    model_id = new_model(client)
    client.post("/forward_backward", json=fb_body(model_id, 1, [datum(TOKENS)]))
    r = client.post("/optim_step", json={"model_id": model_id, "seq_id": 1, "adam_params": ADAM})
    assert r.status_code == 400
    assert r.json()["field"] == "seq_id"
