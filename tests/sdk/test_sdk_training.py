"""TrainingClient requests on the wire and the results they return."""

import pytest
import quilt


def test_train_step_returns_loss_and_merged_metrics(tc, batch):
    result = tc.train_step(batch)
    assert isinstance(result, quilt.TrainStepResult)
    assert result.loss == 1.5
    assert result.metrics == {"loss:sum": 1.5, "grad_norm:mean": 0.25}
    assert result.forward_backward.loss_fn_outputs[0]["logprobs"].shape == [3]


def test_forward_backward_body(server, tc):
    datum = quilt.datum_for_next_token([5, 6, 7], weights=[0.5, 1.0])
    tc.forward_backward([datum], loss_fn_config={"beta": 0.1}).result()
    assert server.bodies("forward_backward")[0] == {
        "model_id": "sess-1:train:0",
        "seq_id": 1,
        "forward_backward_input": {
            "data": [{
                "model_input": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
                "loss_fn_inputs": {
                    "target_tokens": {"data": [6, 7], "dtype": "int64", "shape": [2]},
                    "weights": {"data": [0.5, 1.0], "dtype": "float32", "shape": [2]},
                },
            }],
            "loss_fn": "cross_entropy",
            "loss_fn_config": {"beta": 0.1},
        },
        "type": "forward_backward",
    }


def test_forward_uses_its_own_route_and_type(server, tc, batch):
    out = tc.forward(batch).result()
    body = server.bodies("forward")[0]
    assert body["type"] == "forward" and body["forward_input"]["loss_fn_config"] is None  # tinker's ForwardRequest
    assert out.loss == 1.5


def test_optim_step_body(server, tc):
    tc.optim_step(quilt.AdamParams(learning_rate=2e-4)).result()
    assert server.bodies("optim_step")[0] == {
        "model_id": "sess-1:train:0", "seq_id": 1, "type": "optim_step",
        "adam_params": {"learning_rate": 2e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12,
                        "weight_decay": 0.0, "grad_clip_norm": 0.0},
    }


def test_save_state_body(server, tc):
    tc.save_state("ckpt").result()
    assert server.bodies("save_weights")[0] == {
        "model_id": "sess-1:train:0", "seq_id": 1, "path": "ckpt", "overwrite": False, "type": "save_weights",
    }


def test_get_info_is_plain_json(server, tc):
    assert tc.get_info()["model_data"]["model_name"] == "tiny"
    assert server.bodies("get_info")[0] == {"model_id": "sess-1:train:0", "type": "get_info"}


def test_every_request_carries_api_key(server, tc, batch):
    tc.train_step(batch)
    assert {r.headers["X-API-Key"] for r in server.requests} == {"tml-test-key"}
    assert all(r.url.startswith("http://quilt.test/api/v1/") for r in server.requests)


def test_bad_data_fails_before_sending(server, tc):
    with pytest.raises(TypeError, match="quilt.Datum"):
        tc.forward_backward([[1, 2, 3]])
    assert "forward_backward" not in server.routes_seen()
