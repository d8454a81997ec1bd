"""Server-side custom losses on the running stack: the official tinker SDK uploads a traced loss
(`create_custom_loss`) and `forward_backward_custom` runs it in the trainer's pass, with the same
loss, metrics and update as the SDK's client-side path; hostile graphs are 400s naming their node
while the trainer goes on serving others; a loss is usable only in its own session."""

from __future__ import annotations

import dataclasses
import json

import pytest

tinker = pytest.importorskip("tinker")
import torch  # noqa: E402
from stackutil import datum, fb_body, new_model, wait_future  # noqa: E402
from test_custom_loss import HOSTILE, PPO, _args, _many, _with, ppo_like, wire  # noqa: E402
from tinker import types  # noqa: E402
from tinkerutil import ready  # noqa: E402

from core import custom_loss  # noqa: E402

TINY = "quilt/tiny-qwen3"
RANKS = {"logprobs": 1, "advantages": 1, "old": 1}


@pytest.fixture(autouse=True)
def _offline_sdk(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def long_chain(logprobs):
    x = logprobs
    for _ in range(200):  # 800 nodes
        x = torch.clamp(x * 1.001 + 0.001, -50.0, 0.0)
    return x.sum(), {"custom/last:mean": x.mean()}


def _data() -> list:
    out = []
    for start, n in ((40, 12), (90, 7), (150, 16)):
        toks = list(range(start, start + n + 1))
        out.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={
            "target_tokens": toks[1:],
            "advantages": [((-1.0) ** k) * (0.5 + k / n) for k in range(n)],
            "old": types.TensorData(data=[-4.0 - 0.1 * k for k in range(n)], dtype="float32", shape=[n])}))
    return out


def _logprobs(tc) -> list[float]:
    plain = [types.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]})
             for d in _data()]
    return [x for o in tc.forward(plain, "cross_entropy").result().loss_fn_outputs for x in o["logprobs"].tolist()]


def test_server_side_custom_loss_equals_the_sdks_client_side_path(stack, tenant):
    # eps well above the gradients: Adam's first step is then smooth in them, so equal gradients
    # show as equal weights after it
    adam = types.AdamParams(learning_rate=0.05, eps=0.1)
    with tinker.ServiceClient(base_url=stack.base_url, api_key=tenant.key) as service:
        handle = service.create_custom_loss(ppo_like, RANKS).result()
        assert handle.loss_id is not None  # uploaded: runs on the server
        # A long graph as the SDK writes it (about ten bytes a string) passes the input guard too.
        assert service.create_custom_loss(long_chain, {"logprobs": 1}).result().loss_id is not None
        on_server = ready(service.create_lora_training_client(base_model=TINY, rank=4, seed=11))
        on_client = ready(service.create_lora_training_client(base_model=TINY, rank=4, seed=11))
        before = _logprobs(on_server)

        server = on_server.forward_backward_custom(_data(), handle).result(timeout=180)
        client = on_client.forward_backward_custom(_data(), dataclasses.replace(handle, loss_id=None)).result(timeout=180)
        assert server.metrics["loss:sum"] == pytest.approx(client.metrics["loss:sum"], rel=1e-4, abs=1e-4)
        for key in ("custom/kl:mean", "custom/ratio:sum"):
            assert server.metrics[key] == pytest.approx(client.metrics[key], rel=1e-4, abs=1e-5), key
        for got, want in zip(server.loss_fn_outputs, client.loss_fn_outputs, strict=True):
            assert got["logprobs"].tolist() == pytest.approx(want["logprobs"].tolist(), abs=1e-4)

        on_server.optim_step(adam).result()
        on_client.optim_step(adam).result()
        after_server, after_client = _logprobs(on_server), _logprobs(on_client)
        assert after_server != pytest.approx(before, abs=1e-3)  # the step moved the weights
        assert after_server == pytest.approx(after_client, abs=2e-4)


DEEP = "deep-placeholder"


def _post_loss(http, session_id: str, seq_id: int, body: dict):
    """The body as JSON text; DEEP stands for an argument nested 10,000 tuples deep, which Python's
    JSON encoder cannot write."""
    text = json.dumps({"session_id": session_id, "custom_loss_seq_id": seq_id, **body})
    deep = '{"tuple": [' * 10_000 + '{"ref": "logprobs"}' + "]}" * 10_000
    return http.post("/create_custom_loss", content=text.replace(f'"{DEEP}"', deep),
                     headers={"content-type": "application/json"})


# Over HTTP the million-node graph is past the body limit (413), so the table sends one node too
# many; the graph nested 10,000 deep meets the input guard first (api.input_guard: Python's JSON
# parser gives up), whose 400 names the body, so it is checked by its message.
OVER_HTTP = [(name, _many(custom_loss.MAX_NODES) if name == "a million nodes"
              else _args(3, [DEEP]) if name.startswith("nested") else change,
              "nests deeper than the limit" if name.startswith("nested") else where.split(" ")[0])
             for name, change, where, _why in HOSTILE]


def test_hostile_graphs_are_400s_naming_the_node_and_the_trainer_serves_on(stack):
    hostile, other = stack.create_tenant("hostile"), stack.create_tenant("bystander")
    h, o = stack.http(hostile.key), stack.http(other.key)
    session_id = h.post("/create_session", json={}).json()["session_id"]
    for k, (name, change, named) in enumerate(OVER_HTTP):
        r = _post_loss(h, session_id, k, _with(*PPO, change))
        assert r.status_code == 400, (name, r.text)
        assert named in r.json()["error"], (name, r.json())
    huge = _with(*PPO, _many(1_000_000))
    assert _post_loss(h, session_id, 99, huge).status_code == 413
    assert len(json.dumps(huge)) > 16 * 1024 * 1024

    model_id = new_model(o)
    fut = o.post("/forward_backward", json=fb_body(model_id, 1, [datum(list(range(3, 20)))])).json()
    assert "loss:sum" in wait_future(o, fut["request_id"])["metrics"]


def test_a_loss_is_usable_only_in_its_own_session(stack, tenant):
    owner, stranger = stack.http(tenant.key), stack.http(stack.create_tenant("stranger").key)
    session_id = owner.post("/create_session", json={}).json()["session_id"]
    created = _post_loss(owner, session_id, 0, wire(*PPO))
    assert created.status_code == 200, created.text
    loss_id = wait_future(owner, created.json()["request_id"])["loss_id"]
    # A retry of the same upload answers the same loss; another graph under its seq id is refused.
    assert wait_future(owner, _post_loss(owner, session_id, 0, wire(*PPO)).json()["request_id"])["loss_id"] == loss_id
    assert _post_loss(owner, session_id, 0, wire(lambda logprobs: (logprobs.sum(), {}), {"logprobs": 1})
                      ).status_code == 400
    # Nobody else reads the upload's future.
    assert stranger.post("/retrieve_future", json={"request_id": created.json()["request_id"]}).status_code == 404

    n = 6
    custom = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": list(range(5, 5 + n))}]},
              "loss_fn_inputs": {"target_tokens": {"data": list(range(6, 6 + n)), "dtype": "int64", "shape": [n]},
                                 "advantages": {"data": [1.0] * n, "dtype": "float32", "shape": [n]},
                                 "old": {"data": [-3.0] * n, "dtype": "float32", "shape": [n]}}}
    config = {"loss_id": loss_id}
    own_model = new_model(owner, session_id=session_id)
    other_session_model = new_model(owner)  # same tenant, another session
    stranger_model = new_model(stranger)
    r = owner.post("/forward_backward", json=fb_body(own_model, 1, [custom], "custom", loss_fn_config=config))
    assert r.status_code == 200, r.text
    assert "custom/ratio:sum" in wait_future(owner, r.json()["request_id"])["metrics"]
    for http, model_id in ((owner, other_session_model), (stranger, stranger_model)):
        r = http.post("/forward_backward", json=fb_body(model_id, 1, [custom], "custom", loss_fn_config=config))
        assert r.status_code == 404 and r.json()["field"] == "loss_fn_config.loss_id", r.text
    # A datum without an input the loss reads is a 400 naming it.
    del custom["loss_fn_inputs"]["old"]
    r = owner.post("/forward_backward", json=fb_body(own_model, 2, [custom], "custom", loss_fn_config=config))
    assert r.status_code == 400 and "old" in r.json()["error"], r.text


def test_a_session_holds_a_bounded_number_of_losses(stack, tenant):
    from core.settings import get_api_settings

    limit = get_api_settings().max_custom_losses_per_session
    owner = stack.http(tenant.key)
    session_id = owner.post("/create_session", json={}).json()["session_id"]
    def scaled(k: int) -> dict:
        def loss(logprobs):
            return (logprobs * float(k)).sum(), {}
        return wire(loss, {"logprobs": 1})

    for k in range(limit):
        assert _post_loss(owner, session_id, k, scaled(k)).status_code == 200
    r = _post_loss(owner, session_id, limit, wire(*PPO))
    assert r.status_code == 400 and r.json()["field"] == "session_id", r.text
    assert _post_loss(owner, session_id, 0, scaled(0)).status_code == 200  # a retried upload: still answered
