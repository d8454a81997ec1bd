"""Futures: polling retrieve_future, failures, awaiting."""

import asyncio

import pytest
import quilt


def test_retrieve_future_body(server, tc, batch):
    tc.forward_backward(batch).result()
    assert server.bodies("retrieve_future")[-1] == {"request_id": "req-2", "allow_metadata_only": False}


def test_try_again_is_polled_until_result(server, tc):
    def accept(body):
        answer = server.future({"metrics": {"x:sum": 1.0}}, body)
        pending = {"type": "try_again", "request_id": answer["request_id"], "queue_state": "active"}
        server.answers[answer["request_id"]][:0] = [pending, pending]
        return answer

    server.routes["optim_step"] = accept
    result = tc.optim_step(quilt.AdamParams()).result()
    assert result.metrics == {"x:sum": 1.0}
    assert server.routes_seen().count("retrieve_future") == 1 + 3  # create_model + 3 polls


def test_failed_future_raises_request_failed_error(server, tc, batch):
    accept = server.routes["forward_backward"]

    def fail(body):
        answer = accept(body)
        server.answers[answer["request_id"]] = [{"error": "token 99 out of vocabulary", "category": "user"}]
        return answer

    server.routes["forward_backward"] = fail
    future = tc.forward_backward(batch)
    with pytest.raises(quilt.RequestFailedError) as info:
        future.result()
    assert info.value.category == "user"
    assert info.value.request_id == future.request_id
    assert "vocabulary" in info.value.message
    assert isinstance(info.value, quilt.UserRequestError)


def test_server_category_gives_server_request_error(server, tc):
    accept = server.routes["save_weights"]

    def fail(body):
        answer = accept(body)
        server.answers[answer["request_id"]] = [{"error": "disk full", "category": "server"}]
        return answer

    server.routes["save_weights"] = fail
    with pytest.raises(quilt.ServerRequestError):
        tc.save_state("x").result()


def test_futures_can_be_awaited(server, client, batch):
    async def main():
        tc = await client.create_training_client_async("tiny")
        future = await tc.forward_backward_async(batch)
        output = await future
        step = await tc.train_step_async(batch)
        return future, output, step

    future, output, step = asyncio.run(main())
    assert isinstance(future, quilt.APIFuture)
    assert output.loss == 1.5 and step.loss == 1.5


def test_result_timeout_raises_builtin_timeout(server, tc):
    pending = {"type": "try_again", "request_id": "r", "queue_state": "active"}
    server.routes["retrieve_future"] = lambda body: pending
    future = tc.optim_step(quilt.AdamParams())
    with pytest.raises(TimeoutError):
        future.result(timeout=0.05)
    assert not future.done()


def test_save_state_resolves_to_path(tc):
    assert tc.save_state("ckpt-1").result() == "tinker://sess-1:train:0/weights/ckpt-1"


def test_load_state_body_and_result(server, tc):
    assert tc.load_state("tinker://m/weights/a", optimizer=False).result() is None
    assert server.bodies("load_weights")[0] == {
        "model_id": "sess-1:train:0", "seq_id": 1, "path": "tinker://m/weights/a",
        "optimizer": False, "type": "load_weights",
    }
