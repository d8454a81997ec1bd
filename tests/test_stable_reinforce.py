"""`stable_reinforce` end to end: the official SDK samples with `record_stability_info`, names each
training token's sequence (`Datum.with_provenance`), and the trainer weighs the update against the
logprobs the sampler recorded, not the ones the client sent. Bad provenance is a 400 naming the span.
"""

from __future__ import annotations

import math

import pytest

tinker = pytest.importorskip("tinker")
from stackutil import fb_body, new_model, wait_future  # noqa: E402
from tinker import types  # noqa: E402
from tinkerutil import ready  # noqa: E402

TINY = "quilt/tiny-qwen3"
PROMPT = [40, 41, 42, 43, 44, 45]
PARAMS = types.SamplingParams(max_tokens=6, temperature=1.0, seed=5, stop=[])


def _datum(seq, advantage: float) -> types.Datum:
    """As the cookbook's RL loop builds it: prompt positions with advantage 0, sampled ones with the
    sequence's; `logprobs` deliberately not the sampler's (-7 everywhere)."""
    full = PROMPT + list(seq.tokens)
    n_prompt, n_sampled = len(PROMPT), len(seq.tokens)
    datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={"target_tokens": full[1:], "logprobs": [-7.0] * (len(full) - 1),
                                        "advantages": [0.0] * (n_prompt - 1) + [advantage] * n_sampled})
    sid = seq.sequence_id
    return datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sid, length=n_prompt),
                     types.SampledProvenanceSpan(sequence_id=sid, length=n_sampled - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=n_prompt - 1),
                        types.SampledProvenanceSpan(sequence_id=sid, length=n_sampled)])


def _sampled_logprobs(tc, datum: types.Datum, n_sampled: int) -> list[float]:
    """The trainer's logprob of each sampled token of `datum`."""
    plain = types.Datum(model_input=datum.model_input,
                        loss_fn_inputs={"target_tokens": datum.loss_fn_inputs["target_tokens"]})
    lp = tc.forward([plain], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    return lp[-n_sampled:]


def test_stable_reinforce_weighs_the_update_against_the_samplers_record(stack, tenant):
    with tinker.ServiceClient(base_url=stack.base_url, api_key=tenant.key) as service:
        tc = ready(service.create_lora_training_client(base_model=TINY, rank=4))
        sampler = ready(tc.save_weights_and_get_sampling_client(record_stability_info=True))
        sequences = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, PARAMS).result().sequences
        advantages = (1.0, -0.5)
        data = [_datum(seq, a) for seq, a in zip(sequences, advantages, strict=True)]
        before = [_sampled_logprobs(tc, d, len(s.tokens)) for d, s in zip(data, sequences, strict=True)]

        out = tc.forward_backward(data, "stable_reinforce").result()
        # Literal: -Σ m·ratio·A over the sampled tokens, ratio against the recorded logprobs,
        # m = [1/2 <= ratio <= 2]. The client's -7s would put every ratio past the band (loss 0).
        expected = 0.0
        for lp, seq, a in zip(before, sequences, advantages, strict=True):
            for trainer, recorded in zip(lp, seq.logprobs, strict=True):
                ratio = math.exp(trainer - recorded)
                expected -= (ratio if 0.5 <= ratio <= 2.0 else 0.0) * a
        assert abs(expected) > 1.0
        assert out.metrics["loss:sum"] == pytest.approx(expected, abs=0.02)

        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        after = _sampled_logprobs(tc, data[0], len(sequences[0].tokens))
        assert sum(after) > sum(before[0])  # the rewarded sequence became likelier

        # A second update on the same records, now one policy version behind: still accepted.
        again = tc.forward_backward(data, "stable_reinforce").result()
        assert math.isfinite(again.metrics["loss:sum"])

        # GSPO-token on the same sequences: one ratio per sequence, over the sampled tokens only.
        gspo_data, expected = [], 0.0
        for seq, a in zip(sequences, advantages, strict=True):
            n_prompt, n_sampled = len(PROMPT), len(seq.tokens)
            full = PROMPT + list(seq.tokens)
            datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
                "target_tokens": full[1:], "logprobs": [0.0] * (n_prompt - 1) + list(seq.logprobs),
                "advantages": [0.0] * (n_prompt - 1) + [a] * n_sampled,
                "sequence_ratio_mask": [0.0] * (n_prompt - 1) + [1.0] * n_sampled})
            gspo_data.append(datum)
            now = _sampled_logprobs(tc, datum, n_sampled)
            ratio = math.exp(sum(lp - q for lp, q in zip(now, seq.logprobs, strict=True)) / n_sampled)
            expected -= n_sampled * min(ratio * a, min(max(ratio, 0.8), 1.2) * a)
        gspo = tc.forward_backward(gspo_data, "gspo").result()
        assert gspo.metrics["loss:sum"] == pytest.approx(expected, abs=0.02)


def _spans(sid: str, n_prompt: int, n_sampled: int, *, offset: int = 0) -> dict:
    return {"model_input_spans": [{"prompt_tokens": {"sequence_id": sid, "length": n_prompt}},
                                  {"sampled_tokens": {"sequence_id": sid, "length": n_sampled - 1}}],
            "loss_fn_input_spans": [{"prompt_tokens": {"sequence_id": sid, "offset": 1, "length": n_prompt - 1}},
                                    {"sampled_tokens": {"sequence_id": sid, "offset": offset,
                                                        "length": n_sampled}}]}


def _rl_datum(tokens: list[int], n_prompt: int, **extra) -> dict:
    n = len(tokens) - 1
    return {"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
            "loss_fn_inputs": {"target_tokens": {"data": tokens[1:], "dtype": "int64", "shape": [n]},
                               "logprobs": {"data": [0.0] * n, "dtype": "float32", "shape": [n]},
                               "advantages": {"data": [0.0] * (n_prompt - 1) + [1.0] * (n - n_prompt + 1),
                                              "dtype": "float32", "shape": [n]}},
            **extra}


def test_bad_provenance_is_a_400_naming_the_span(stack, tenant):
    with tinker.ServiceClient(base_url=stack.base_url, api_key=tenant.key) as service:
        recorded = service.create_sampling_client(base_model=TINY, record_stability_info=True)
        plain = service.create_sampling_client(base_model=TINY)
        [seq] = recorded.sample(types.ModelInput.from_ints(PROMPT), 1, PARAMS).result().sequences
        [unrecorded] = plain.sample(types.ModelInput.from_ints(PROMPT), 1, PARAMS).result().sequences
    other = stack.create_tenant("provenance-other")
    with tinker.ServiceClient(base_url=stack.base_url, api_key=other.key) as service:
        theirs = service.create_sampling_client(base_model=TINY, record_stability_info=True)
        [their_seq] = theirs.sample(types.ModelInput.from_ints(PROMPT), 1, PARAMS).result().sequences

    http = stack.http(tenant.key)
    model_id = new_model(http, rank=4)
    tokens, n_prompt, n_sampled = PROMPT + list(seq.tokens), len(PROMPT), len(seq.tokens)
    good = _spans(seq.sequence_id, n_prompt, n_sampled)
    wrong = list(tokens)
    wrong[-2] = (wrong[-2] + 1) % 1000
    seq_id = 0

    def post(datum: dict, loss_fn: str = "stable_reinforce"):
        nonlocal seq_id
        seq_id += 1
        r = http.post("/forward_backward", json=fb_body(model_id, seq_id, [datum], loss_fn))
        if r.status_code == 400 and r.json()["field"].startswith("forward_backward_input."):
            seq_id -= 1  # refused by the body guard before the call was read: the id stays free (api.seq_gaps)
        return r

    def spans_with(field: str, index: int, kind: str, **change) -> dict:
        spans = {k: [dict(s) for s in v] for k, v in good.items()}
        spans[field][index] = {kind: {**good[field][index][kind], **change}}
        return spans

    cases = [
        (_rl_datum(tokens, n_prompt), "data[0].loss_fn_input_spans", "needs provenance"),
        (_rl_datum(tokens, n_prompt, loss_fn_input_spans=good["loss_fn_input_spans"]),
         "data[0].loss_fn_input_spans", "comes as a pair"),
        (_rl_datum(tokens, n_prompt, **spans_with("loss_fn_input_spans", 1, "sampled_tokens", length=n_sampled + 1)),
         "data[0].loss_fn_input_spans", "must tile"),
        (_rl_datum(tokens, n_prompt, **spans_with("loss_fn_input_spans", 1, "sampled_tokens", sequence_id="a\x00b")),
         "data[0].loss_fn_input_spans[1].sampled_tokens.sequence_id", "NUL"),
        (_rl_datum(tokens, n_prompt, **spans_with("loss_fn_input_spans", 1, "sampled_tokens", length=-1)),
         "data[0].loss_fn_input_spans[1].sampled_tokens.length", "integer in"),
        (_rl_datum(tokens, n_prompt, **spans_with("loss_fn_input_spans", 1, "sampled_tokens", offset=2**40)),
         "data[0].loss_fn_input_spans[1].sampled_tokens.offset", "integer in"),
        (_rl_datum(tokens, n_prompt, **{**good, "loss_fn_input_spans": [{"mystery": {}}]}),
         "data[0].loss_fn_input_spans[0]", "sampled_tokens"),
        (_rl_datum(tokens, n_prompt, **spans_with("loss_fn_input_spans", 1, "sampled_tokens",
                                                  sequence_id=their_seq.sequence_id)),
         "data[0].loss_fn_input_spans[1].sequence_id", "no recorded sequence"),
        (_rl_datum(tokens, n_prompt, **spans_with("loss_fn_input_spans", 1, "sampled_tokens",
                                                  sequence_id=unrecorded.sequence_id)),
         "data[0].loss_fn_input_spans[1].sequence_id", "no recorded sequence"),
        (_rl_datum(wrong, n_prompt, **good), "data[0].loss_fn_input_spans[1]", "sampled token"),
        (_rl_datum(tokens, n_prompt, **_spans(seq.sequence_id, n_prompt, n_sampled, offset=1)),
         "data[0].loss_fn_input_spans[1]", "run past"),
    ]
    for datum, field, words in cases:
        r = post(datum)
        assert r.status_code == 400, (field, r.text)
        # (a NUL is refused by the body guard, which names the field by its full JSON path)
        assert r.json()["field"].endswith(field) and words in r.json()["detail"], (field, r.json())
    # The tenant's model is unharmed: the good request trains, and another loss accepts provenance.
    for loss_fn in ("stable_reinforce", "importance_sampling"):
        ok = post(_rl_datum(tokens, n_prompt, **good), loss_fn)
        assert ok.status_code == 200, ok.text
        result = wait_future(http, ok.json()["request_id"])
        assert "error" not in result and math.isfinite(result["metrics"]["loss:sum"]), result
