"""Provenance spans parsed and applied (api.provenance): the parts that need no store, as tables.
The Redis lookup and the SDK's own encoding run in tests/test_stable_reinforce.py."""

from __future__ import annotations

import pytest

from api import provenance
from api.provenance import Provenance, Span
from core.errors import InvalidInput
from core.work import Datum


def _record(tokens: list[int], logprobs: list[float | None], prompt_length: int = 3, version: int = 4) -> dict:
    return {"tokens": tokens, "logprobs": logprobs, "prompt_length": prompt_length, "policy_version": version}


RECORDS = {"s:0": _record([7, 8, 9], [-0.5, None, -1.5]), "s:1": _record([5, 6], [-0.25, -0.75], version=2)}
# The datum: prompt [1, 2, 3] then s:0's [7, 8, 9], then s:1's [5, 6] after an observation token 4.
TARGETS = (2, 3, 7, 8, 9, 4, 5, 6)


def _datum(policy_version: int | None = None) -> Datum:
    n = len(TARGETS)
    return Datum(tokens=(1,) * n, inputs={"target_tokens": TARGETS, "logprobs": (-9.0,) * n,
                                          "advantages": tuple(float(k + 1) for k in range(n))},
                 policy_version=policy_version)


SPANS = (Span("prompt", "s:0", 1, 2), Span("sampled", "s:0", 0, 3), Span("prompt", "s:1", 3, 0),
         Span("sampled", "s:1", 0, 0), Span("prompt", "s:1", 2, 1), Span("sampled", "s:1", 0, 2))


def test_the_record_replaces_the_clients_logprobs_and_only_sampled_positions_keep_their_advantage():
    out = provenance._rewrite("data[0]", _datum(), Provenance((), SPANS), RECORDS)
    assert out.inputs["logprobs"] == (0.0, 0.0, -0.5, 0.0, -1.5, 0.0, -0.25, -0.75)
    # a sampled token without a finite recorded logprob weighs nothing, like a prompt token
    assert out.inputs["advantages"] == (0.0, 0.0, 3.0, 0.0, 5.0, 0.0, 7.0, 8.0)
    assert out.inputs["target_tokens"] == TARGETS
    assert out.policy_version == 2  # the oldest weights behind it
    assert provenance._rewrite("data[0]", _datum(9), Provenance((), SPANS), RECORDS).policy_version == 9


@pytest.mark.parametrize("spans, field, words", [
    ((Span("prompt", "s:0", 1, 2), Span("sampled", "s:0", 1, 3)), "data[0].loss_fn_input_spans[1]", "run past the 3 sampled"),
    ((Span("prompt", "s:0", 2, 2),), "data[0].loss_fn_input_spans[0]", "run past the 3 prompt"),
    ((Span("prompt", "s:0", 0, 2), Span("sampled", "s:1", 0, 2)), "data[0].loss_fn_input_spans[1]",
     "target_tokens[2] is 7 but sampled token 0 of 's:1' is 5"),
    ((Span("sampled", "gone", 0, 1),), "data[0].loss_fn_input_spans[0].sequence_id", "no recorded sequence 'gone'"),
])
def test_a_span_that_does_not_match_its_record_is_named(spans, field, words):
    with pytest.raises(InvalidInput) as err:
        provenance._rewrite("data[0]", _datum(), Provenance((), spans), RECORDS)
    assert err.value.field == field and words in str(err.value)


@pytest.mark.parametrize("raw, field, words", [
    ([{"sampled_tokens": {"sequence_id": "s", "length": 1}, "prompt_tokens": {}}], "x[0]", "must be"),
    ([{"sampled_tokens": {"sequence_id": "s", "length": 1, "extra": 1}}], "x[0].sampled_tokens", "takes"),
    ([{"sampled_tokens": {"sequence_id": "", "length": 1}}], "x[0].sampled_tokens.sequence_id", "non-empty"),
    ([{"sampled_tokens": {"sequence_id": "s" * 301, "length": 1}}], "x[0].sampled_tokens.sequence_id", "300"),
    ([{"sampled_tokens": {"sequence_id": "s\ud800", "length": 1}}], "x[0].sampled_tokens.sequence_id", "surrogate"),
    ([{"prompt_tokens": {"sequence_id": "s", "length": True}}], "x[0].prompt_tokens.length", "integer"),
    ([{"prompt_tokens": {"sequence_id": "s", "length": 1.5}}], "x[0].prompt_tokens.length", "integer"),
    ([{"prompt_tokens": {"sequence_id": "s", "length": 2**31}}], "x[0].prompt_tokens.length", "integer"),
    ([{"prompt_tokens": {"sequence_id": "s"}}], "x[0].prompt_tokens.length", "integer"),
    ([{"sampled_tokens": {"sequence_id": "s", "length": 1}}] * 4097, "x", "4097 spans"),
])
def test_hostile_spans_are_refused_by_name(raw, field, words):
    with pytest.raises(InvalidInput) as err:
        provenance.from_json(raw, "x")
    assert err.value.field == field and words in str(err.value)


def test_spans_come_in_pairs_and_tile_their_field():
    spans = provenance.from_json([{"prompt_tokens": {"sequence_id": "s", "length": 2}},
                                  {"sampled_tokens": {"sequence_id": "s", "offset": 1, "length": 3}}], "x")
    assert spans == (Span("prompt", "s", 0, 2), Span("sampled", "s", 1, 3))
    assert provenance.pair(None, None, "data[0]") is None
    with pytest.raises(InvalidInput, match="as a pair"):
        provenance.pair(spans, None, "data[0]")
    provenance.check_tiling(Provenance(spans, spans), 5, "data[0]")
    with pytest.raises(InvalidInput) as err:
        provenance.check_tiling(Provenance(spans, spans[:1]), 5, "data[0]")
    assert err.value.field == "data[0].loss_fn_input_spans" and "cover 2 positions but the datum has 5" in str(err.value)
