"""Sampling through the real stack (API, trainer, generation worker with vLLM), via the SDK and raw
HTTP: versioned weights, trainer/sampler agreement, deadlines, cancellation, isolation, bad input."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import quilt
from stackutil import TINY, base_sampler, wait_future

pytestmark = pytest.mark.stack

# The sampler (vLLM, fp32) and the trainer (torch + PEFT, fp32) compute the same logprobs; the
# tolerance covers summation-order differences (measured ~1e-5).
LOGPROB_TOL = 1e-3
PROMPT = [5, 6, 7, 8, 9]


def _train(tc: quilt.TrainingClient, steps: int) -> None:
    datum = quilt.datum_for_next_token([5, 6, 7, 8, 9, 10, 11, 12])
    for _ in range(steps):
        tc.train_step([datum], adam=quilt.AdamParams(learning_rate=1e-2))


def _trainer_logprobs(tc: quilt.TrainingClient, prompt: list[int], completion: list[int]) -> list[float]:
    out = tc.forward([quilt.datum_for_next_token(prompt + completion)]).result()
    return out.loss_fn_outputs[0]["logprobs"].data[len(prompt) - 1:]


def test_published_versions_are_tagged_and_served_without_restart(stack, tenant):
    with stack.sdk(tenant.key) as client:
        tc = client.create_training_client(TINY, rank=8, seed=1)
        snapshot = tc.save_weights_and_get_sampling_client()
        _train(tc, 2)
        path = tc.save_weights_for_sampler("pub").result()
        assert path == f"tinker://{tc.model_id}/sampler_weights/pub"
        sampler = client.create_sampling_client(model_path=path)
        params = quilt.SamplingParams(max_tokens=6, seed=3, stop=[])
        v2 = sampler.sample(PROMPT, 3, params).result()
        assert [(s.model_id, s.policy_version) for s in v2.sequences] == [(tc.model_id, 2)] * 3
        assert all(len(s.tokens) == 6 and s.stop_reason == "length" for s in v2.sequences)
        for seq in v2.sequences:  # the sampler's logprobs are the trainer's (torch + PEFT) logprobs
            expected = _trainer_logprobs(tc, PROMPT, seq.tokens)
            assert max(abs(a - b) for a, b in zip(seq.logprobs, expected)) < LOGPROB_TOL

        # Publish the same name again: the same sampler serves the new version, no restart.
        _train(tc, 1)
        tc.save_weights_for_sampler("pub").result()
        v3 = sampler.sample(PROMPT, 1, params).result().sequences[0]
        assert v3.policy_version == 3
        assert max(abs(a - b) for a, b in zip(v3.logprobs, _trainer_logprobs(tc, PROMPT, v3.tokens))) < LOGPROB_TOL

        # The anonymous snapshot still samples the weights it was taken from (before training).
        old = snapshot.sample(PROMPT, 1, params).result().sequences[0]
        assert old.policy_version == 0
        base = client.create_sampling_client(base_model=TINY).sample(PROMPT, 1, params).result().sequences[0]
        assert (base.model_id, base.policy_version) == (TINY, 0)
        # A fresh LoRA's B is zero: the untrained snapshot samples exactly like the base.
        assert old.tokens == base.tokens


def test_compute_logprobs_matches_the_trainer(stack, tenant):
    with stack.sdk(tenant.key) as client:
        tc = client.create_training_client(TINY, rank=4, seed=2)
        _train(tc, 2)
        sampler = tc.save_weights_and_get_sampling_client()
        tokens = [5, 6, 7, 8, 9, 10, 40, 41]
        lps = sampler.compute_logprobs(tokens).result()
        assert lps[0] is None and len(lps) == len(tokens)
        expected = _trainer_logprobs(tc, tokens[:1], tokens[1:])
        assert max(abs(a - b) for a, b in zip(lps[1:], expected)) < LOGPROB_TOL


def test_group_completes_with_all_samples_and_stop_tokens(stack, tenant):
    with stack.sdk(tenant.key) as client:
        sampler = client.create_sampling_client(base_model=TINY)
        free = sampler.sample(PROMPT, 4, quilt.SamplingParams(max_tokens=12, seed=9, stop=[])).result()
        assert len(free.sequences) == 4 and len({s.sequence_id for s in free.sequences}) == 4
        assert all(len(s.tokens) == 12 and len(s.logprobs) == 12 for s in free.sequences)
        first = free.sequences[0].tokens
        stop_tok = first[4]
        stopped = sampler.sample(PROMPT, 1, quilt.SamplingParams(max_tokens=12, seed=9, stop=[stop_tok])).result()
        seq = stopped.sequences[0]
        assert seq.stop_reason == "stop" and seq.tokens == first[: first.index(stop_tok) + 1]


def _asample(client, sampler_id: str, **kw) -> dict:
    body = {"sampling_session_id": sampler_id, "num_samples": kw.pop("n", 1),
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": kw.pop("tokens", PROMPT)}]},
            "sampling_params": kw.pop("params", {"max_tokens": 4}), **kw}
    return client.post("/asample", json=body)


def test_deadline_aborts_and_reports(stack, tenant):
    http = stack.http(tenant.key)
    sampler = base_sampler(http)
    r = _asample(http, sampler, n=2, params={"max_tokens": 1900, "stop": []}, deadline_s=0.5)
    assert r.status_code == 200 and len(r.json()["sample_sequence_ids"]) == 2
    result = wait_future(http, r.json()["request_id"])
    assert result["category"] == "user" and "deadline" in result["error"], result
    assert result["field"] == "deadline_s"  # what quilt.rl counts as an infra failure
    # The pool is still healthy and serves the next request.
    ok = wait_future(http, _asample(http, sampler, params={"max_tokens": 3}).json()["request_id"])
    assert len(ok["sequences"][0]["tokens"]) == 3


def test_cancel_future_aborts(stack, tenant):
    http = stack.http(tenant.key)
    sampler = base_sampler(http)
    rid = _asample(http, sampler, params={"max_tokens": 1900, "stop": []}).json()["request_id"]
    assert http.post("/cancel_future", json={"request_id": rid}).status_code == 200
    result = wait_future(http, rid)
    assert result["category"] == "user" and "cancelled" in result["error"], result


def test_other_tenants_samplers_are_404(stack):
    a, b = stack.create_tenant("a"), stack.create_tenant("b")
    with stack.sdk(a.key) as client:
        tc = client.create_training_client(TINY, rank=4, seed=0)
        path = tc.save_weights_for_sampler("mine").result()
        sampler = client.create_sampling_client(model_path=path)
    http = stack.http(b.key)
    session = http.post("/create_session", json={}).json()["session_id"]
    r = http.post("/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 0,
                                                    "model_path": path})
    assert r.status_code == 404
    assert http.get(f"/samplers/{sampler.sampling_session_id}").status_code == 404
    assert _asample(http, sampler.sampling_session_id).status_code == 404
    r = http.post("/asample", json={"model_path": path, "num_samples": 1,
                                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]}})
    assert r.status_code == 404
    r = http.post("/save_weights_for_sampler", json={"model_id": tc.model_id, "seq_id": 9, "path": "x"})
    assert r.status_code == 404


@pytest.mark.parametrize("change, field", [
    ({"params": {"max_tokens": 4, "temperature": -1}}, "sampling_params.temperature"),
    ({"params": {"max_tokens": 4, "top_p": 0}}, "sampling_params.top_p"),
    ({"params": {"max_tokens": 4, "top_k": 0}}, "sampling_params.top_k"),
    ({"params": {"max_tokens": 10**7}}, "sampling_params.max_tokens"),
    ({"params": {"max_tokens": 0}}, "sampling_params.max_tokens"),
    ({"params": {"max_tokens": 4, "stop": [1, "x"]}}, "sampling_params.stop"),
    ({"params": {"max_tokens": 4, "seed": -1}}, "sampling_params.seed"),
    ({"tokens": [5, 100_000]}, "prompt"),
    ({"tokens": [5, -1]}, "prompt"),
    ({"tokens": []}, "prompt"),
    ({"n": 0}, "num_samples"),
    ({"n": 100_000}, "num_samples"),
    ({"topk_prompt_logprobs": 10**6}, "topk_prompt_logprobs"),
    ({"topk_prompt_logprobs": -1}, "topk_prompt_logprobs"),
    ({"topk_sample_logprobs": 10**6}, "topk_sample_logprobs"),
    ({"topk_sample_logprobs": -1}, "topk_sample_logprobs"),
    ({"topk_sample_logprobs": 2**40}, "topk_sample_logprobs"),
    ({"prompt_alt_tokens_k": 10**6}, "prompt_alt_tokens_k"),
    ({"prompt_alt_tokens_k": -1}, "prompt_alt_tokens_k"),
    # target_prompt_logprobs: [len(prompt) - 1, K] int64 (tests/test_sampling_outputs.py has the full table)
    ({"target_prompt_logprobs": {"data": [7, -1], "dtype": "int64", "shape": [2, 1]}}, "target_prompt_logprobs"),
    ({"target_prompt_logprobs": {"data": [7, -1, 3, 1e300], "dtype": "int64", "shape": [4, 1]}},
     "target_prompt_logprobs"),
    ({"target_prompt_logprobs": {"data": [7, 8], "dtype": "int64", "shape": [4, 2], "sparse_crow_indices": [0, 2, 2, 2, 2],
                                 "sparse_col_indices": [1, 0]}}, "target_prompt_logprobs"),
    ({"target_prompt_logprobs": {"data": [7], "dtype": "int64", "shape": [4, 2], "sparse_crow_indices": [0, 1, 1, 1, 1],
                                 "sparse_col_indices": [9]}}, "target_prompt_logprobs"),
    ({"target_prompt_logprobs": {"data": [-1] * 4, "dtype": "int64", "shape": [4, 1]}}, "target_prompt_logprobs"),
    ({"target_prompt_logprobs": "7"}, "target_prompt_logprobs"),
    # QUILT_GEN_MAX_PROBE_ROWS (512): one probe per scored prompt row
    ({"tokens": [5] * 514, "prompt_alt_tokens_k": 1}, "prompt_alt_tokens_k"),
    ({"tokens": [5] * 514, "target_prompt_logprobs": {"data": [7] * 513, "dtype": "int64", "shape": [513, 1]}},
     "target_prompt_logprobs"),
    ({"record_stability_info": {"x": 1}}, "record_stability_info"),
    ({"deadline_s": -1}, "deadline_s"),
    ({"episode_id": ""}, "episode_id"),
    ({"episode_id": "x" * 129}, "episode_id"),
    ({"episode_id": "ep\u00001"}, "episode_id"),
    ({"episode_id": "<script>"}, "episode_id"),
    ({"episode_id": 7}, "episode_id"),
    ({"episode_id": "ep-1", "episode_hint": "sideways"}, "episode_hint"),
    ({"episode_hint": "promote"}, ""),  # a hint needs its episode
])
def test_bad_sampling_requests_are_4xx(stack, tenant, change, field):
    http = stack.http(tenant.key)
    r = _asample(http, base_sampler(http), **change)
    assert r.status_code == 400, r.text
    assert r.json()["field"].startswith(field), r.json()


def test_bad_adapter_fails_only_its_request(stack, tenant):
    with stack.sdk(tenant.key) as client:
        tc = client.create_training_client(TINY, rank=4, seed=0)
        path = tc.save_weights_for_sampler("broken").result()
        storage = next(Path(stack.data_dir, "checkpoints").glob(f"*/{tc.model_id}/sampler_weights/broken/*"))
        (storage / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
        sampler = client.create_sampling_client(model_path=path)
        with pytest.raises(quilt.UserRequestError, match="adapter"):
            sampler.sample(PROMPT, 1, quilt.SamplingParams(max_tokens=3)).result()
        shutil.rmtree(storage)
        with pytest.raises(quilt.UserRequestError, match="adapter"):
            sampler.sample(PROMPT, 1, quilt.SamplingParams(max_tokens=3)).result()
        good = tc.save_weights_and_get_sampling_client()
        assert len(good.sample(PROMPT, 2, quilt.SamplingParams(max_tokens=3)).result().sequences) == 2


def test_published_weights_are_those_of_their_place_in_order_whatever_follows(stack, tenant):
    """Sampler weights are written off the trainer's loop (batcher.exports): an optim_step sent
    right behind the save, without waiting, must not reach into the files being written."""
    from safetensors.torch import load_file
    from stackutil import ADAM, datum, fb_body, new_model

    from core import db

    client = stack.http(tenant.key)
    model_id = new_model(client, rank=8, seed=2)
    steps = [("/forward_backward", fb_body(model_id, 1, [datum([5, 6, 7, 8, 9, 10])])),
             ("/optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": ADAM}),
             ("/forward_backward", fb_body(model_id, 3, [datum([9, 8, 7, 6, 5, 4])])),
             ("/save_weights_for_sampler", {"model_id": model_id, "seq_id": 4, "path": "in-order"}),
             ("/save_weights", {"model_id": model_id, "seq_id": 5, "path": "in-order-ref"}),
             ("/optim_step", {"model_id": model_id, "seq_id": 6, "adam_params": ADAM}),
             ("/save_weights", {"model_id": model_id, "seq_id": 7, "path": "after"})]
    futures = [client.post(route, json=body).json()["request_id"] for route, body in steps]  # all at once
    results = [wait_future(client, f) for f in futures]
    assert all("error" not in r for r in results), results
    assert results[3]["policy_version"] == 1
    with db.connect(stack.database_url) as conn:
        paths = {r["name"]: r["storage_path"] for r in conn.execute(
            "SELECT name, storage_path FROM checkpoints WHERE model_id = %s", (model_id,)).fetchall()}
    published, ref, after = (load_file(str(Path(paths[n]) / "adapter_model.safetensors"))
                             for n in ("in-order", "in-order-ref", "after"))
    assert published.keys() == ref.keys()
    assert all((published[k] == ref[k]).all() for k in ref)  # the weights at seq_id 4, bit for bit
    assert any((published[k] != after[k]).any() for k in ref)  # and the step after it changed them


def _storage(stack, model_id: str, name: str) -> str:
    from core import db

    with db.connect(stack.database_url) as conn:
        return conn.execute("SELECT storage_path FROM checkpoints WHERE model_id = %s AND name = %s",
                            (model_id, name)).fetchone()["storage_path"]


def test_topk_prompt_logprobs_match_a_torch_recomputation(stack, tenant):
    from genutil import Reference

    from bases import catalog
    from core import db

    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    with stack.sdk(tenant.key) as client:
        tc = client.create_training_client(TINY, rank=8, seed=4)
        _train(tc, 2)
        path = tc.save_weights_for_sampler("topk").result()
        sampler = client.create_sampling_client(model_path=path)
        out = sampler.sample(prompt, 2, quilt.SamplingParams(max_tokens=2, seed=1), include_prompt_logprobs=True,
                             topk_prompt_logprobs=5).result()
    with db.connect(stack.database_url) as conn:
        base_path = catalog.get_model_sync(conn, TINY).path
    expected = Reference(base_path).prompt_topk(_storage(stack, tc.model_id, "topk"), prompt, 5)
    assert out.topk_prompt_logprobs[0] is None and len(out.topk_prompt_logprobs) == len(prompt)
    for got, want in zip(out.topk_prompt_logprobs[1:], expected, strict=True):
        assert [t for t, _ in got] == [t for t, _ in want]
        assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) < LOGPROB_TOL
    # The prompt's own logprob is the same number as its entry among the top k, where it is one.
    for i, row in enumerate(out.topk_prompt_logprobs[1:], start=1):
        mine = dict(row).get(prompt[i])
        if mine is not None:
            assert abs(mine - out.prompt_logprobs[i]) < 1e-6


def test_topk_alone_and_last_n_through_http(stack, tenant):
    http = stack.http(tenant.key)
    sampler = base_sampler(http)
    r = _asample(http, sampler, topk_prompt_logprobs=2, prompt_logprobs_last_n=2)
    result = wait_future(http, r.json()["request_id"])
    assert "prompt_logprobs" not in result  # not asked for
    rows = result["topk_prompt_logprobs"]
    assert len(rows) == len(PROMPT) and rows[:-2] == [None] * (len(PROMPT) - 2)
    assert all(len(row) == 2 and row[0][1] >= row[1][1] for row in rows[-2:])


def test_sampling_outputs_as_json(stack, tenant):
    """The JSON result (what a client without protobuf reads) carries every output; a seeded request
    draws the same alternatives again."""
    http = stack.http(tenant.key)
    sampler = base_sampler(http)
    target = {"data": [7, 9, 5, 11], "dtype": "int64", "shape": [4, 2], "sparse_crow_indices": [0, 2, 2, 3, 4],
              "sparse_col_indices": [0, 1, 1, 0]}
    results, request_ids = [], []
    for _ in range(2):
        r = _asample(http, sampler, n=2, params={"max_tokens": 3, "seed": 5, "temperature": 1.0},
                     topk_sample_logprobs=2, target_prompt_logprobs=target, prompt_alt_tokens_k=3)
        assert r.status_code == 200, r.text
        request_ids.append(r.json()["request_id"])
        results.append(wait_future(http, request_ids[-1]))
    result = results[0]
    assert all(len(s["topk_logprobs"]) == len(s["tokens"]) == 3 for s in result["sequences"])
    got = result["target_prompt_logprobs"]
    assert (got["shape"], got["dtype"], got["sparse_crow_indices"]) == ([4, 2], "float32", [0, 2, 2, 3, 4])
    assert len(got["data"]) == 4 and all(v < 0 for v in got["data"])
    alts = result["prompt_alt_tokens"]
    assert alts["tokens"]["shape"] == alts["logprobs"]["shape"] == [4, 3]
    # The same draws; logprobs to about 1e-6 (a batch of another size sums in another order).
    again = results[1]
    assert again["prompt_alt_tokens"]["tokens"] == alts["tokens"]
    assert again["target_prompt_logprobs"]["data"] == pytest.approx(got["data"], abs=1e-4)
    # Billed as any sample: the prompt once at the prefill rate, its read by the second sequence at the
    # cached rate, and the sampled tokens; nothing for the outputs.
    from core import db

    with db.connect(stack.database_url) as conn:
        rows = conn.execute("SELECT prefill_tokens, cached_tokens, sample_tokens, train_tokens FROM usage_ledger "
                            "WHERE request_id = ANY(%s)", (request_ids,)).fetchall()
    billed = [(r["prefill_tokens"], r["cached_tokens"], r["sample_tokens"], r["train_tokens"]) for r in rows]
    assert billed == [(len(PROMPT), len(PROMPT), 6, 0)] * 2


def test_a_seed_reproduces_a_sample(stack, tenant):
    """Same seed, same server, same weights: the same group, also when other requests share the
    engine's batches (each sequence has its own generator, seeded from the request's seed)."""
    with stack.sdk(tenant.key) as client:
        sampler = client.create_sampling_client(base_model=TINY)
        params = quilt.SamplingParams(max_tokens=12, temperature=1.0, seed=1234, stop=[])
        first = sampler.sample(PROMPT, 4, params)
        noise = [sampler.sample(PROMPT, 3, quilt.SamplingParams(max_tokens=20, stop=[])) for _ in range(3)]
        second = sampler.sample(PROMPT, 4, params)
        a, b = first.result().sequences, second.result().sequences
        [n.result() for n in noise]
        assert [s.tokens for s in a] == [s.tokens for s in b]
        assert len({tuple(s.tokens) for s in a}) > 1  # the group's sequences still differ from each other
        other = sampler.sample(PROMPT, 4, quilt.SamplingParams(max_tokens=12, seed=99, stop=[])).result()
        assert [s.tokens for s in other.sequences] != [s.tokens for s in a]
        unseeded = [sampler.sample(PROMPT, 1, quilt.SamplingParams(max_tokens=12, stop=[])).result()
                    .sequences[0].tokens for _ in range(2)]
        assert unseeded[0] != unseeded[1]
