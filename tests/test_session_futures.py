"""tinker's session protocols: one `retrieve_futures` long-poll names every finished request of a
sampling session's clone, and `join_sampling_session` numbers the copies of a sampling client, so
the official SDK (which the server's client/config turns both on for) samples through them."""

from __future__ import annotations

import pickle
import time

import pytest
from stackutil import TINY, base_sampler, wait_future

from core.queue import CLONE_SPAN, MAX_CLONE, future_key

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinkerutil import ready  # noqa: E402

PROMPT = [40, 41, 42, 43]


def _sample(http, sampler: str, seq_id: int, **params) -> str:
    r = http.post("/asample", json={"sampling_session_id": sampler, "seq_id": seq_id, "num_samples": 1,
                                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
                                    "sampling_params": {"max_tokens": 3, **params}})
    assert r.status_code == 200, r.text
    return r.json()["request_id"]


def _poll(http, sampler: str, clone: int = 0, cursor: int = 0, timeout: float | None = 30) -> dict:
    r = http.post("/retrieve_futures", json={"target": {"type": "sampling_session", "sampling_session_id": sampler,
                                                        "cloned_sampler_id": clone},
                                             "prev_cursor": cursor, "timeout": timeout})
    assert r.status_code == 200, r.text
    return r.json()


def test_one_poll_names_a_clones_finished_and_failed_requests(stack, tenant, r):
    http = stack.http(tenant.key)
    sampler = base_sampler(http)
    first = _sample(http, sampler, 1)
    body = _poll(http, sampler)
    assert [c["request_id"] for c in body["completions"]] == [first]
    assert body["completions"][0]["state"] == "finished"
    assert body["completions"][0]["response_payload_uncompressed_size"] > 0
    assert body["cursor"] > 0
    result = wait_future(http, first)  # the result itself is still read with retrieve_future
    assert len(result["sequences"][0]["tokens"]) == 3

    # What was seen is not sent again; a timeout of 0 answers at once.
    assert _poll(http, sampler, cursor=body["cursor"], timeout=0) == {"completions": [], "cursor": body["cursor"]}

    # A clone's requests (seq_ids from clone * 10^9) are its own; a failure is named as one.
    cancelled = _sample(http, sampler, 3 * CLONE_SPAN + 1, max_tokens=1900, stop=[])
    assert http.post("/cancel_future", json={"request_id": cancelled}).status_code == 200
    clone = _poll(http, sampler, clone=3)
    assert clone["completions"] == [{"state": "failed", "request_id": cancelled}]
    assert _poll(http, sampler, cursor=body["cursor"], timeout=0)["completions"] == []

    # Results the client says it has read for good are deleted at its next poll: only its own
    # sampling results (another tenant's, or a result of another kind, stay).
    other = stack.create_tenant("other")
    theirs = _sample(stack.http(other.key), base_sampler(stack.http(other.key)), 1)
    wait_future(stack.http(other.key), theirs)
    model = http.post("/create_model", json={"session_id": http.post("/create_session", json={}).json()["session_id"],
                                             "model_seq_id": 0, "base_model": TINY, "lora_config": {"rank": 2}})
    created = model.json()["request_id"]
    wait_future(http, created)
    acked = http.post("/retrieve_futures", json={"target": {"sampling_session_id": sampler}, "timeout": 0,
                                                 "prev_cursor": body["cursor"],
                                                 "retrieved_request_ids": [first, theirs, created, "nope"]})
    assert acked.status_code == 200
    assert [r.exists(future_key(x)) for x in (first, theirs, created)] == [0, 1, 1]
    gone = http.post("/retrieve_future", json={"request_id": first})
    assert gone.status_code == 410, gone.text

    # Copies of the client get numbers of their own, from 1.
    join = [http.post("/join_sampling_session", json={"sampling_session_id": sampler}) for _ in range(2)]
    assert [j.json() for j in join] == [{"type": "join_sampling_session", "client_counter": n} for n in (1, 2)]


def test_another_tenants_session_is_404_and_bad_polls_are_400(stack):
    a, b = stack.create_tenant("a"), stack.create_tenant("b")
    sampler = base_sampler(stack.http(a.key))
    other = stack.http(b.key)
    r = other.post("/retrieve_futures", json={"target": {"sampling_session_id": sampler}, "timeout": 0})
    assert r.status_code == 404 and r.json()["field"] == "sampling_session_id"
    r = other.post("/join_sampling_session", json={"sampling_session_id": sampler})
    assert r.status_code == 404 and r.json()["field"] == "sampling_session_id"
    assert other.post("/join_sampling_session", json={"sampling_session_id": "nope:sample:0"}).status_code == 404

    mine = stack.http(a.key)
    target = {"sampling_session_id": sampler}
    for body, field in [
        ({"target": target, "prev_cursor": -1}, "prev_cursor"),
        ({"target": target, "prev_cursor": 2**63}, "prev_cursor"),
        ({"target": target, "timeout": -1}, "timeout"),
        ({"target": target, "timeout": "NaN"}, "timeout"),
        ({"target": {**target, "type": "model"}}, "type"),
        ({"target": {**target, "cloned_sampler_id": MAX_CLONE + 1}}, "cloned_sampler_id"),
        ({"target": {**target, "cloned_sampler_id": -1}}, "cloned_sampler_id"),
        ({"target": {"sampling_session_id": "x" * 257}}, "sampling_session_id"),
        ({"target": target, "retrieved_request_ids": [f"req-{i:028d}" for i in range(10_001)]}, "retrieved_request_ids"),
        ({}, "target"),
    ]:
        r = mine.post("/retrieve_futures", json=body)
        assert r.status_code == 400 and field in r.text, (body, r.status_code, r.text[:300])
    r = mine.post("/asample", json={"sampling_session_id": sampler, "seq_id": 2**63, "num_samples": 1,
                                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]}})
    assert r.status_code == 400 and "seq_id" in r.text


def test_the_official_sdk_samples_through_the_session_poller_and_its_copies_join(stack, tenant, r):
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=5, stop=[])
    prompt = types.ModelInput.from_ints(PROMPT)
    stored = len(r.keys(future_key("*")))
    with tinker.ServiceClient(base_url=stack.base_url, api_key=tenant.key) as service:
        sampler = ready(service.create_sampling_client(base_model=TINY))
        futures = [sampler.sample(prompt, 1, params) for _ in range(6)]
        assert all(len(f.result().sequences[0].tokens) == 4 for f in futures)
        assert sampler._futures_poller is not None  # the flag from client/config took effect
        # The SDK reports the six results read on its next poll, and they are deleted.
        deadline = time.monotonic() + 20
        while len(r.keys(future_key("*"))) > stored and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(r.keys(future_key("*"))) == stored

        # Unpickled copies (what a multiprocess rollout does) ask the server for their numbers.
        copies = [pickle.loads(pickle.dumps(sampler)) for _ in range(2)]
        outs = [c.sample(prompt, 2, params) for c in copies]
        assert all(len(o.result().sequences) == 2 for o in outs)
        assert sorted(c._cloned_sampler_id for c in copies) == [1, 2]
