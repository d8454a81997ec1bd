"""seq_id ordering: create_model is 0, then 1, 2, 3, ... per model, in call order."""

import httpx
import pytest
import quilt


def _seq_ids(server, model_id):
    return [
        r.body["seq_id"] for r in server.requests
        if isinstance(r.body, dict) and r.body.get("model_id") == model_id and "seq_id" in r.body
    ]


def test_seq_ids_count_from_one_per_model(server, client, batch):
    a = client.create_training_client("tiny")
    b = client.create_training_client("tiny")
    a.forward_backward(batch)
    a.optim_step(quilt.AdamParams())
    b.forward(batch)
    a.save_state("ckpt")
    assert _seq_ids(server, a.model_id) == [1, 2, 3]
    assert _seq_ids(server, b.model_id) == [1]
    assert [body["model_seq_id"] for body in server.bodies("create_model")] == [0, 1]


def test_create_model_sends_no_seq_id(server, tc):
    assert "seq_id" not in server.bodies("create_model")[0]


def test_train_step_submits_both_before_waiting(server, tc, batch):
    # The forward_backward result is held back until optim_step arrives; a client that
    # waited for it before submitting optim_step would poll forever (capped here).
    polls = []

    def retrieve(body):
        polls.append(body["request_id"])
        if "optim_step" not in server.routes_seen():
            if len(polls) > 50:
                return {"error": "optim_step never submitted", "category": "user"}
            return {"type": "try_again", "request_id": body["request_id"], "queue_state": "active"}
        return server.retrieve(body)

    server.routes["retrieve_future"] = retrieve
    result = tc.train_step(batch)
    assert result.loss == 1.5
    assert [r for r in server.routes_seen() if r in ("forward_backward", "optim_step")] == [
        "forward_backward", "optim_step",
    ]
    assert [b["seq_id"] for b in server.bodies("forward_backward") + server.bodies("optim_step")] == [1, 2]


def test_resubmission_after_5xx_reuses_seq_id(server, tc, batch):
    answers = [httpx.Response(503, json={"detail": "busy"}, headers={"Retry-After": "0"})]
    accept = server.routes["forward_backward"]
    server.routes["forward_backward"] = lambda body: answers.pop() if answers else accept(body)
    tc.forward_backward(batch).result()
    assert [b["seq_id"] for b in server.bodies("forward_backward")] == [1, 1]


def test_a_final_refusal_uses_up_its_seq_id(server, tc, batch):
    # The server records a 400 (or 402, 404, ...) at its seq_id, so the next call takes the next id.
    accept = server.routes["optim_step"]
    server.routes["optim_step"] = lambda body: httpx.Response(400, json={"detail": "bad"})
    with pytest.raises(quilt.BadRequestError):
        tc.optim_step(quilt.AdamParams())
    server.routes["optim_step"] = accept
    tc.optim_step(quilt.AdamParams())
    assert [b["seq_id"] for b in server.bodies("optim_step")] == [1, 2]


@pytest.mark.parametrize("status", sorted(quilt.training.SEQ_FREE_STATUSES))
def test_a_refusal_that_keeps_nothing_frees_its_seq_id(server, tc, batch, status):
    accept = server.routes["optim_step"]
    server.routes["optim_step"] = lambda body: httpx.Response(status, json={"detail": "no"},
                                                              headers={"Retry-After": "0"})
    with pytest.raises(quilt.APIStatusError):
        tc.optim_step(quilt.AdamParams())
    server.routes["optim_step"] = accept
    tc.optim_step(quilt.AdamParams())
    assert {b["seq_id"] for b in server.bodies("optim_step")} == {1}  # retried ones too
