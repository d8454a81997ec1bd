"""OpenAI-compatible inference, driven by the `openai` package: completions and chat, streaming and
not, on a base and on a tenant's published weights, through the same admission as `asample`
(bad key 401, another tenant's weights 404, a spent budget 402, metering) and the same engine
(the answer's tokens are the ones the pool samples with the same seed)."""

from __future__ import annotations

import json

import openai
import pytest
import quilt
from billing_workload import ledger_rows, wait_recorded
from stackutil import TINY

from billing import budgets
from core import db


def _client(stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def published(stack):
    owner = stack.create_tenant("oa")
    with stack.sdk(owner.key) as client:
        tc = client.create_training_client(TINY, rank=8, seed=7)
        datum = quilt.datum_for_next_token(list(range(30, 46)))
        for _ in range(2):
            tc.train_step([datum], adam=quilt.AdamParams(learning_rate=2e-2))
        path = tc.save_weights_for_sampler("eval").result()
    return owner, path


def test_completions_on_a_base_and_on_published_weights(stack, published):
    owner, path = published
    client = _client(stack, owner.key)
    for model in (TINY, path):
        out = client.completions.create(model=model, prompt="alice has 3 apples", max_tokens=8, n=2, seed=5,
                                        temperature=1.0)
        assert out.object == "text_completion" and len(out.choices) == 2
        assert all(c.finish_reason in ("stop", "length") for c in out.choices)
        assert out.usage.prompt_tokens > 0 and 0 < out.usage.completion_tokens <= 16
        again = client.completions.create(model=model, prompt="alice has 3 apples", max_tokens=8, n=2, seed=5)
        assert [c.text for c in again.choices] == [c.text for c in out.choices]  # the seed holds here too


def test_the_answer_is_what_the_pool_samples(stack, published):
    """Token ids in, the same tokens out as `asample` gives for the same prompt, seed and weights."""
    owner, path = published
    prompt = [5, 6, 7, 8, 9]
    with stack.sdk(owner.key) as sdk:
        seq = sdk.create_sampling_client(model_path=path).sample(
            prompt, 1, quilt.SamplingParams(max_tokens=6, seed=11, temperature=1.0, stop=[])).result().sequences[0]
    out = _client(stack, owner.key).completions.create(model=path, prompt=prompt, max_tokens=6, seed=11)
    from transformers import AutoTokenizer

    from bases import catalog

    with db.connect(stack.database_url) as conn:
        tok = AutoTokenizer.from_pretrained(catalog.get_model_sync(conn, TINY).path)
    assert out.choices[0].text == tok.decode(seq.tokens, skip_special_tokens=True)


def test_chat_uses_the_bases_chat_format_and_streams(stack, published):
    owner, path = published
    client = _client(stack, owner.key)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "how many apples?"}]
    out = client.chat.completions.create(model=path, messages=messages, max_tokens=6, seed=3)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    # ChatML (the tiny base's renderer): system + user turns and the assistant's opening.
    assert out.usage.prompt_tokens > 10
    stream = client.chat.completions.create(model=path, messages=messages, max_tokens=6, seed=3, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == out.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason
    # Text arrives as it is sampled: several chunks, together the unstreamed answer (same seed).
    plain = client.completions.create(model=TINY, prompt="bob has", max_tokens=24, seed=1)
    streamed = list(client.completions.create(model=TINY, prompt="bob has", max_tokens=24, seed=1, stream=True))
    pieces = [c.choices[0].text for c in streamed if c.choices[0].text]
    assert "".join(pieces) == plain.choices[0].text
    if plain.usage.completion_tokens >= 4 and len(plain.choices[0].text) >= 4:
        assert len(pieces) >= 2, pieces
    assert streamed[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    # The worker published the tokens step by step (core.queue.delta_key), all of them.
    from core import queue, redis_client

    entries = redis_client.sync_client(stack.redis_url).xrange(queue.delta_key(streamed[0].id.removeprefix("cmpl-")))
    assert sum(len(json.loads(fields[b"t"])) for _, fields in entries) == plain.usage.completion_tokens
    assert len(entries) > 1 or plain.usage.completion_tokens == 1
    two = list(client.completions.create(model=TINY, prompt="bob has", max_tokens=8, seed=2, n=2, stream=True))
    assert {c.choices[0].index for c in two} == {0, 1}


def test_echo_with_logprobs_scores_the_prompt_as_evaluators_ask(stack, published):
    """The request loglikelihood evaluators send (lm-eval's completions backend): token ids,
    echo, logprobs=1, max_tokens=0. The prompt's logprobs are the engine's, checked against torch
    + PEFT on the same weights; the top-1 alternative says whether each token was the greedy one."""
    from genutil import Reference

    from bases import catalog

    owner, path = published
    tokens = [5, 6, 7, 8, 9, 10, 11, 12]
    out = _client(stack, owner.key).completions.create(model=path, prompt=tokens, echo=True, logprobs=1,
                                                       max_tokens=0)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(tokens) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    run, _, name = path.removeprefix("tinker://").split("/")
    with db.connect(stack.database_url) as conn:
        base_path = catalog.get_model_sync(conn, TINY).path
        adapter = conn.execute("SELECT storage_path FROM checkpoints WHERE model_id = %s AND name = %s",
                               (run, name)).fetchone()["storage_path"]
    expected = Reference(base_path).token_logprobs(adapter, tokens)
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], expected, strict=True)) < 1e-3
    for got, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert len(top) == 1 and max(top.values()) >= got - 1e-6
    assert lp.text_offset == sorted(lp.text_offset)
    # Text prompt, echo, one sampled token: the text is the prompt's text plus the sample.
    more = _client(stack, owner.key).completions.create(model=TINY, prompt="alice has", echo=True, logprobs=0,
                                                        max_tokens=1, seed=0)
    assert more.choices[0].text.startswith("alice has") and more.choices[0].logprobs.top_logprobs[1] is None


def test_errors_are_the_ones_openai_clients_expect(stack, published):
    owner, path = published
    with pytest.raises(openai.AuthenticationError):
        _client(stack, "tml-not-a-key").completions.create(model=TINY, prompt="x", max_tokens=2)
    other = stack.create_tenant("oa-other")
    with pytest.raises(openai.NotFoundError):
        _client(stack, other.key).completions.create(model=path, prompt="x", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        _client(stack, owner.key).completions.create(model="no/such-model", prompt="x", max_tokens=2)
    client = _client(stack, owner.key)
    for bad in ({"max_tokens": 10**8}, {"temperature": -1}, {"n": 10**6}, {"logprobs": 3}, {"prompt": [10**9]},
                {"max_tokens": 0}, {"echo": True, "logprobs": 10**6}, {"echo": True, "stream": True}):
        kw = {"model": TINY, "prompt": "x", "max_tokens": 2, **bad}
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**kw)
    for bad in ({"max_tokens": 0}, {"max_completion_tokens": 0}, {"logprobs": True}, {"n": 10**6}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "x"}], **bad)
    # What the openai package cannot send: a lone surrogate, NUL, deep nesting, escaped in raw JSON.
    import httpx

    raw = httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {owner.key}",
                                                          "Content-Type": "application/json"}, timeout=60)
    for body in ('{"model": "%s", "prompt": "\\ud800 x"}' % TINY, '{"model": "%s", "prompt": "a\\u0000b"}' % TINY,
                 '{"model": "%s", "messages": %s}' % (TINY, "[" * 5000 + "]" * 5000)):
        for route in ("/v1/completions", "/v1/chat/completions"):
            r = raw.post(route, content=body)
            assert 400 <= r.status_code < 500, (route, body[:60], r.status_code, r.text[:200])


def test_a_spent_budget_is_402_and_usage_is_metered(stack):
    tenant = stack.create_tenant("oa-budget")
    client = _client(stack, tenant.key)
    client.completions.create(model=TINY, prompt="alice has 3 apples", max_tokens=8)
    wait_recorded(stack.database_url, [tenant.tenant_id])
    (row,) = ledger_rows(stack.database_url, [tenant.tenant_id])
    assert row["prefill_tokens"] > 0 and 0 < row["sample_tokens"] <= 8 and row["base_model"] == TINY
    with db.connect(stack.database_url) as conn:
        budgets.set_budget(conn, tenant.tenant_id, 0)
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert refused.value.status_code == 402


class _Letters:
    """A tokenizer of one letter per token id, for the decoder alone."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_a_stream_sampled_again_from_the_start_skips_what_it_sent():
    from api.routes.openai_compat import _Decoder

    d = _Decoder(_Letters())
    assert d.add([0, 1], 0) + d.add([2], 2) == "abc"
    assert d.add([0, 1], 0) + d.add([2, 3], 2) == "d"  # a re-run repeating itself, then new tokens
    assert d.finish([0, 1, 2, 3, 4]) == "e" and not d.diverged
    other = _Decoder(_Letters())
    assert other.add([0, 1], 0) == "ab"
    assert other.add([5], 0) == "" and other.diverged  # an unseeded re-run: what was sent is void
    assert other.add([6], 1) == ""
    assert _Decoder(_Letters()).add([7, 8]) == "hi"  # entries written before offsets: appended


def test_text_past_the_context_is_refused_before_tokenizing(stack, published):
    """MAX_CHARS_PER_TOKEN characters per context token at most: a longer prompt is a 400 naming
    the field and the bound, answered without tokenizing it."""
    from api.routes.openai_compat import MAX_CHARS_PER_TOKEN
    from bases import catalog

    owner, _ = published
    with db.connect(stack.database_url) as conn:
        context = catalog.get_model_sync(conn, TINY).max_context_length
    client = _client(stack, owner.key)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=TINY, prompt="a" * (MAX_CHARS_PER_TOKEN * context + 1), max_tokens=2)
    answer = refused.value.response.json()
    assert answer["field"] == "prompt" and f"{MAX_CHARS_PER_TOKEN * context:,}" in answer["error"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=TINY, max_tokens=2, messages=[
            {"role": "user", "content": "b" * (MAX_CHARS_PER_TOKEN * context // 2 + 1)}] * 2)
    assert refused.value.response.json()["field"] == "messages"


@pytest.mark.parametrize("stream", [False, True])
def test_a_caller_who_leaves_stops_its_sampling(stack, published, stream):
    """The caller gives up before the answer: its sampling request is cancelled (its future fails
    `cancelled`) instead of running to max_tokens for nobody."""
    import time

    import httpx

    from bases import catalog

    owner = stack.create_tenant(f"oa-left-{int(stream)}")
    with db.connect(stack.database_url) as conn:
        context = catalog.get_model_sync(conn, TINY).max_context_length
    body = {"model": TINY, "prompt": [5, 6], "max_tokens": context - 4, "temperature": 1.0, "stream": stream,
            "stop": [], "seed": 1}
    started = time.monotonic()
    with httpx.Client(timeout=httpx.Timeout(60, read=2)) as client:
        if stream:  # read the first chunk, then hang up
            with client.stream("POST", f"{stack.base_url}/v1/completions", json=body,
                               headers={"Authorization": f"Bearer {owner.key}"}) as r:
                assert r.status_code == 200
                next(r.iter_bytes())
        else:
            with pytest.raises(httpx.ReadTimeout):
                client.post(f"{stack.base_url}/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {owner.key}"})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with db.connect(stack.database_url) as conn:
            row = conn.execute("SELECT id, status FROM requests WHERE tenant_id = %s AND kind = 'sample'",
                               (owner.tenant_id,)).fetchone()
        if row and row["status"] in ("done", "failed"):
            break
        time.sleep(0.5)
    assert row["status"] == "failed", row
    with stack.http(owner.key) as api:
        future = api.post("/retrieve_future", json={"request_id": row["id"]}).json()
    assert "cancel" in json.dumps(future), future
    assert time.monotonic() - started < 60
