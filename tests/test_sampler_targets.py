"""What tinker-cookbook's recipes send that the core flow does not: a sampler named by both its
weights and their base (on-policy distillation's teacher), and JSON forward bodies in tinker's own
field names."""

from __future__ import annotations

import pytest

tinker = pytest.importorskip("tinker")
from stackutil import TINY, datum, new_model, wait_future  # noqa: E402
from tinker import types  # noqa: E402

pytestmark = pytest.mark.stack


def _published(client, model_id: str) -> str:
    r = client.post("/save_weights_for_sampler", json={"model_id": model_id, "seq_id": 1, "path": "teacher"})
    assert r.status_code == 200, r.text
    return wait_future(client, r.json()["request_id"])["path"]


def test_a_sampler_named_by_its_weights_and_their_base_samples_the_weights(stack, tenant):
    with stack.http(tenant.key) as client:
        path = _published(client, new_model(client))
    with tinker.ServiceClient(base_url=stack.base_url, api_key=tenant.key) as service:
        teacher = service.create_sampling_client(base_model=TINY, model_path=path).result()
        out = teacher.sample(types.ModelInput.from_ints([5, 6, 7]), num_samples=2,
                             sampling_params=types.SamplingParams(max_tokens=4, seed=1)).result()
        assert len(out.sequences) == 2 and all(len(s.tokens) == 4 for s in out.sequences)


@pytest.mark.parametrize("route", ["/create_sampling_session", "/asample"])
def test_a_base_that_is_not_the_weights_base_is_refused_naming_it(stack, tenant, route):
    with stack.http(tenant.key) as client:
        path = _published(client, new_model(client))
        session = client.post("/create_session", json={}).json()["session_id"]
        body = {"model_path": path, "base_model": "acme/other-base"}
        if route == "/create_sampling_session":
            body |= {"session_id": session, "sampling_session_seq_id": 0}
        else:
            body |= {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}, "num_samples": 1}
        r = client.post(route, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["field"] == "base_model" and TINY in r.json()["detail"]
        if route == "/create_sampling_session":
            neither = client.post(route, json={"session_id": session, "sampling_session_seq_id": 1})
            assert neither.status_code == 400 and "model_path" in neither.text


def test_json_forward_takes_tinkers_forward_input_and_the_old_name(stack, tenant):
    with stack.http(tenant.key) as client:
        model_id = new_model(client)
        inputs = {"data": [datum(list(range(1, 12)))], "loss_fn": "cross_entropy"}
        results = []
        for seq, name in ((1, "forward_input"), (2, "forward_backward_input")):
            r = client.post("/forward", json={"model_id": model_id, "seq_id": seq, name: inputs})
            assert r.status_code == 200, r.text
            results.append(wait_future(client, r.json()["request_id"]))
        assert results[0]["metrics"]["loss:sum"] == results[1]["metrics"]["loss:sum"]
        missing = client.post("/forward", json={"model_id": model_id, "seq_id": 3})
        assert missing.status_code == 400 and "forward_input" in missing.text
