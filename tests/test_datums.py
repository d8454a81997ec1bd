"""Datum validation names the field and the limit; it is one function for every encoding."""

from __future__ import annotations

import math

import pytest

from api.datums import Limits, RawDatum, RawTensor, normalise
from core.errors import InvalidInput

LIMITS = Limits(vocab_size=100, max_context_length=16, max_datums=4, max_tokens=40)


def d(tokens, targets=None, weights=None) -> RawDatum:
    targets = targets if targets is not None else tokens
    inputs = {"target_tokens": RawTensor(targets, "int64", [len(targets)])}
    if weights is not None:
        inputs["weights"] = RawTensor(weights, "float32", None)
    return RawDatum(tokens, inputs)


def err(data, loss_fn="cross_entropy") -> InvalidInput:
    with pytest.raises(InvalidInput) as info:
        normalise(data, loss_fn, LIMITS)
    return info.value


def test_good_data_is_normalised_and_counted():
    out, n = normalise([d([1, 2, 3], weights=[1, 0, 1])], "cross_entropy", LIMITS)
    assert n == 3
    assert out == [{"tokens": [1, 2, 3], "inputs": {"target_tokens": [1, 2, 3], "weights": [1.0, 0.0, 1.0]}}]


@pytest.mark.parametrize("data, field, words", [
    ([], "data", ["at least one"]),
    ([d([1])] * 5, "data", ["5 datums", "limit of 4"]),
    ([d([1] * 17)], "data[0].model_input", ["17 tokens", "context length 16"]),
    ([d([1] * 15)] * 3, "data", ["45", "limit of 40"]),
    ([d([1, 100])], "data[0].model_input", ["100", "[0, 100)"]),
    ([d([1, 2], targets=[1, 2, 3])], "data[0].loss_fn_inputs.target_tokens", ["3 values", "2 tokens"]),
    ([d([1, 2], weights=[1.0, math.nan])], "data[0].loss_fn_inputs.weights", ["finite"]),
    ([RawDatum([1, 2], {})], "data[0].loss_fn_inputs", ["target_tokens"]),
])
def test_errors_name_the_field_and_the_limit(data, field, words):
    e = err(data)
    assert e.field == field
    for w in words:
        assert w in e.message


def test_unknown_loss_and_foreign_inputs():
    assert err([d([1, 2])], "mystery").field == "loss_fn"
    extra = RawDatum([1, 2], {"target_tokens": RawTensor([1, 2], "int64", None), "advantages": RawTensor([1, 1], "", None)})
    assert "advantages" in err([extra]).message


def test_two_dimensional_inputs_are_refused_clearly():
    two_d = RawDatum([1, 2], {"target_tokens": RawTensor([1, 2, 3, 4], "int64", [2, 2])})
    assert "1-D" in err([two_d]).message
