"""The Quilt SDK against the real stack: train_step, futures, typed errors, save and load."""

from __future__ import annotations

import asyncio

import pytest
import quilt

TINY = "quilt/tiny-qwen3"


def _data():
    return [quilt.datum_for_next_token(list(range(s, s + 20))) for s in (30, 60, 90)]


def test_train_step_returns_loss_and_it_falls(stack, tenant):
    with stack.sdk(tenant.key) as client:
        tc = client.create_training_client(TINY, rank=8, seed=1)
        adam = quilt.AdamParams(learning_rate=1e-2)
        first = tc.train_step(_data(), "cross_entropy", adam)
        for _ in range(4):
            last = tc.train_step(_data(), "cross_entropy", adam)
        assert last.loss < first.loss
        assert "grad_norm:mean" in last.metrics and "loss:sum" in last.metrics
        assert len(last.forward_backward.loss_fn_outputs) == 3
        assert len(last.forward_backward.loss_fn_outputs[0]["logprobs"].data) == 19


def test_futures_can_be_awaited(stack, tenant):
    async def run():
        async with stack.sdk(tenant.key) as client:
            tc = await client.create_training_client_async(TINY, rank=4)
            fut = await tc.forward_async(_data())
            return await fut

    out = asyncio.run(run())
    assert out.loss > 0


def test_save_and_load_state_round_trip(stack, tenant):
    with stack.sdk(tenant.key) as client:
        tc = client.create_training_client(TINY, rank=4, seed=3)
        tc.train_step(_data(), adam=quilt.AdamParams(learning_rate=1e-2))
        path = tc.save_state("rt").result()
        before = tc.forward(_data()).result().loss
        tc.train_step(_data(), adam=quilt.AdamParams(learning_rate=1e-2))
        assert tc.forward(_data()).result().loss != before
        tc.load_state(path).result()
        assert tc.forward(_data()).result().loss == before


def test_failed_future_raises_a_user_request_error(stack, tenant):
    with stack.sdk(tenant.key) as client:
        tc = client.create_training_client(TINY, rank=4)
        tc.save_state("taken").result()
        with pytest.raises(quilt.UserRequestError) as info:  # the name exists: the trainer refuses
            tc.save_state("taken").result()
        assert info.value.request_id and "already exists" in str(info.value)


def test_http_errors_are_typed(stack, tenant):
    with stack.sdk(tenant.key) as client:
        tc = client.create_training_client(TINY, rank=4)
        with pytest.raises(quilt.BadRequestError) as info:
            tc.forward_backward(_data(), loss_fn="mystery").result()
        assert info.value.status_code == 400 and info.value.request_id
    with pytest.raises(quilt.AuthenticationError):
        with stack.sdk("tml-wrong") as client:
            client.create_training_client(TINY, rank=4)


def test_sdk_cancels_a_sampling_request(stack, tenant):
    with stack.sdk(tenant.key) as client:
        sampler = client.create_sampling_client(base_model=TINY)
        future = sampler.sample([5, 6, 7], 2, quilt.SamplingParams(max_tokens=1900, stop=[]))
        assert future.cancel().result(timeout=60)["request_id"] == future.request_id
        with pytest.raises(quilt.UserRequestError, match="cancelled"):
            future.result(timeout=120)
