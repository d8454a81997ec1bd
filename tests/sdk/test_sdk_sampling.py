"""SamplingClient and the TrainingClient's sampling calls on the wire (fake server)."""

import time

import pytest
import quilt

SEQ = {"tokens": [4, 5, 0], "logprobs": [-1.0, -2.0, -0.5], "stop_reason": "stop", "model_id": "sess-1:train:0",
       "policy_version": 3}


@pytest.fixture
def sampling_server(server):
    sessions = {}

    def create_sampling_session(body):
        sid = f"{body['session_id']}:sample:{body['sampling_session_seq_id']}"
        sessions[sid] = body
        return {"sampling_session_id": sid, "type": "create_sampling_session"}

    def asample(body):
        answer = server.future({"type": "sample", "sequences": [SEQ] * body["num_samples"],
                                **({"prompt_logprobs": [None, -0.25, -0.5]} if body["prompt_logprobs"] else {})},
                               body)
        answer["sample_sequence_ids"] = [f"{answer['request_id']}:{i}" for i in range(body["num_samples"])]
        return answer

    def save_for_sampler(body):
        if "sampling_session_seq_id" in body:
            result = {"sampling_session_id": f"sess-1:sample:{body['sampling_session_seq_id']}",
                      "path": f"tinker://{body['model_id']}/sampler_weights/anon-{body['seq_id']}"}
        else:
            result = {"path": f"tinker://{body['model_id']}/sampler_weights/{body['path']}"}
        return server.future({"type": "save_weights_for_sampler", "policy_version": 3, **result}, body)

    server.routes.update({
        "create_sampling_session": create_sampling_session,
        "asample": asample,
        "save_weights_for_sampler": save_for_sampler,
        "samplers/sess-1:sample:0": lambda body: {"sampler_id": "sess-1:sample:0", "base_model": "tiny",
                                                  "model_path": sessions["sess-1:sample:0"].get("model_path")},
    })
    return server


def test_sample_body_and_result(sampling_server, client):
    sampler = client.create_sampling_client(base_model="tiny")
    params = quilt.SamplingParams(max_tokens=5, temperature=0.7, stop=["\n"], seed=3)
    out = sampler.sample([1, 2, 3], 2, params).result()
    body = sampling_server.bodies("asample")[0]
    assert body == {
        "sampling_session_id": "sess-1:sample:0", "seq_id": 0, "num_samples": 2,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 5, "temperature": 0.7, "top_k": -1, "top_p": 1.0, "seed": 3, "stop": ["\n"]},
        "prompt_logprobs": False, "topk_prompt_logprobs": 0, "topk_sample_logprobs": 0, "type": "sample",
    }
    assert isinstance(out, quilt.SampleResponse) and len(out.sequences) == 2
    first = out.sequences[0]
    assert (first.tokens, first.stop_reason, first.model_id, first.policy_version) == ([4, 5, 0], "stop",
                                                                                      "sess-1:train:0", 3)
    assert first.sequence_id.endswith(":0") and out.sequences[1].sequence_id.endswith(":1")
    sampler.sample([1], 1)
    assert sampling_server.bodies("asample")[1]["seq_id"] == 1


def test_compute_logprobs(sampling_server, client):
    sampler = client.create_sampling_client(base_model="tiny")
    assert sampler.compute_logprobs([1, 2, 3]).result() == [None, -0.25, -0.5]
    body = sampling_server.bodies("asample")[0]
    assert body["prompt_logprobs"] is True and body["num_samples"] == 1
    assert body["sampling_params"]["max_tokens"] == 1


def test_sampler_from_path_asks_for_its_base(sampling_server, client):
    path = "tinker://sess-1:train:0/sampler_weights/s1"
    sampler = client.create_sampling_client(model_path=path)
    assert (sampler.base_model, sampler.model_path) == ("tiny", path)
    assert "samplers/sess-1:sample:0" in sampling_server.routes_seen()


def test_save_weights_and_get_sampling_client_is_anonymous(sampling_server, client, tc):
    sampler = tc.save_weights_and_get_sampling_client()
    body = sampling_server.bodies("save_weights_for_sampler")[0]
    assert body == {"model_id": "sess-1:train:0", "seq_id": 1, "sampling_session_seq_id": 0, "kind": "snapshot",
                    "type": "save_weights_for_sampler"}
    assert sampler.sampling_session_id == "sess-1:sample:0" and sampler.base_model == "tiny"
    # The same per-session counter numbers samplers made by the Client.
    client.create_sampling_client(base_model="tiny")
    assert sampling_server.bodies("create_sampling_session")[0]["sampling_session_seq_id"] == 1


def test_named_save_for_sampler(sampling_server, tc):
    assert tc.save_weights_for_sampler("s1").result() == "tinker://sess-1:train:0/sampler_weights/s1"
    assert sampling_server.bodies("save_weights_for_sampler")[0]["path"] == "s1"


def test_async_variants(sampling_server, client):
    import asyncio

    async def go():
        sampler = await client.create_sampling_client_async(base_model="tiny")
        future = await sampler.sample_async([1, 2], 1)
        return await future

    assert asyncio.run(go()).sequences[0].tokens == [4, 5, 0]


@pytest.mark.parametrize("kwargs", [{"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": 0}])
def test_sampling_params_refuse_bad_values(kwargs):
    with pytest.raises(ValueError):
        quilt.SamplingParams(**kwargs)


@pytest.mark.parametrize("stop, wire", [(None, None), ([], []), ("x", "x"), ([0, 7], [0, 7])])
def test_stop_forms(stop, wire):
    assert quilt.SamplingParams(stop=stop).to_json().get("stop") == wire


def test_bad_arguments_fail_before_sending(sampling_server, client):
    with pytest.raises(ValueError, match="exactly one"):
        client.create_sampling_client()
    with pytest.raises(ValueError, match="tinker://"):
        client.create_sampling_client(model_path="/etc/passwd")
    sampler = client.create_sampling_client(base_model="tiny")
    with pytest.raises(ValueError):
        sampler.sample([1], 0)
    assert "asample" not in sampling_server.routes_seen()


def test_cancel_asks_the_server_to_abort_a_sampling_request(sampling_server, client, tc):
    sampling_server.routes["cancel_future"] = lambda body: {"type": "cancel_future", "request_id": body["request_id"]}
    sampler = client.create_sampling_client(base_model="tiny")
    future = sampler.sample([1, 2], 1)
    assert future.cancel().result(timeout=10) == {"type": "cancel_future", "request_id": future.request_id}
    assert sampling_server.bodies("cancel_future") == [{"request_id": future.request_id}]
    # training requests run in order on the trainer and cannot be aborted
    with pytest.raises(TypeError, match="only sampling"):
        tc.forward_backward([quilt.datum_for_next_token([1, 2, 3])]).cancel()


def test_samples_wait_on_one_session_poll_and_report_what_they_read(sampling_server, client):
    """With the server's retrieve_futures, a sample's result is read once the session poll names
    it (never polled per request while pending), and the next poll reports it as read."""
    polls, reported = [], set()

    def retrieve_futures(body):  # every accepted request is finished: each is named once
        polls.append(body)
        done = [{"state": "finished", "request_id": r, "response_payload_uncompressed_size": 10}
                for r in sampling_server.answers if r not in reported]
        reported.update(d["request_id"] for d in done)
        return {"completions": done, "cursor": body["prev_cursor"] + len(done)}

    sampling_server.routes["retrieve_futures"] = retrieve_futures
    sampler = client.create_sampling_client(base_model="tiny")
    futures = [sampler.sample([1, 2, 3], 1) for _ in range(5)]
    assert all(f.result().sequences[0].tokens == SEQ["tokens"] for f in futures)
    ids = {f.request_id for f in futures}
    assert polls and all(p["target"] == {"type": "sampling_session", "sampling_session_id": "sess-1:sample:0",
                                         "cloned_sampler_id": 0} for p in polls)
    assert sorted(b["request_id"] for b in sampling_server.bodies("retrieve_future")) == sorted(ids)  # one read each
    deadline = time.monotonic() + 5
    while not ids <= {r for p in polls for r in p["retrieved_request_ids"]}:
        assert time.monotonic() < deadline, polls
        time.sleep(0.01)
    assert polls[-1]["timeout"] == 0  # reporting alone does not hold a long poll
    assert not sampler._poller.off


def test_a_server_without_retrieve_futures_is_polled_per_request(sampling_server, client):
    sampler = client.create_sampling_client(base_model="tiny")
    futures = [sampler.sample([1, 2, 3], 1) for _ in range(3)]
    assert all(f.result().sequences[0].tokens == SEQ["tokens"] for f in futures)
    assert sampler._poller.off
    assert sampling_server.routes_seen().count("retrieve_futures") == 1  # tried once, then never again
    assert sampler.sample([1, 2, 3], 1).result().sequences[0].tokens == SEQ["tokens"]
    assert sampling_server.routes_seen().count("retrieve_futures") == 1
