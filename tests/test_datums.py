"""Datum validation names the field and the limit; it is one function for every encoding."""

from __future__ import annotations

import math

import pytest

from api.datums import Limits, RawDatum, RawTensor, normalise, pass_work
from core.errors import InvalidInput
from core.loss_spec import LossConfig, spec_of
from core.work import Datum, PassWork

LIMITS = Limits(vocab_size=100, max_context_length=16, max_datums=4, max_tokens=40)


def d(tokens, targets=None, weights=None) -> RawDatum:
    targets = targets if targets is not None else tokens
    inputs = {"target_tokens": RawTensor(targets, "int64", [len(targets)])}
    if weights is not None:
        inputs["weights"] = RawTensor(weights, "float32", None)
    return RawDatum(tokens, inputs)


def err(data, loss_fn="cross_entropy") -> InvalidInput:
    with pytest.raises(InvalidInput) as info:
        normalise(data, spec_of(loss_fn), LIMITS)
    return info.value


def test_good_data_is_normalised_and_counted():
    out, n = normalise([d([1, 2, 3], weights=[1, 0, 1])], spec_of("cross_entropy"), LIMITS)
    assert n == 3
    assert out == (Datum((1, 2, 3), {"target_tokens": (1, 2, 3), "weights": (1.0, 0.0, 1.0)}),)


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


def test_two_dimensional_inputs_of_an_rl_loss_are_refused_clearly():
    # cross_entropy takes (N, K) top-K targets: tests/test_topk_targets.py
    two_d = _rl([1, 2])
    two_d.inputs["advantages"] = RawTensor([1.0] * 4, "float32", [2, 2])
    with pytest.raises(InvalidInput) as exc:
        normalise([two_d], spec_of("importance_sampling"), LIMITS)
    assert "expected [2]" in exc.value.message and exc.value.field == "data[0].loss_fn_inputs.advantages"


def _rl(tokens, **extra) -> RawDatum:
    n = len(tokens)
    inputs = {"target_tokens": RawTensor(tokens, "int64", None), "logprobs": RawTensor([-1.0] * n, "float32", None),
              "advantages": RawTensor([1.0] * n, "float32", None)}
    return RawDatum(tokens, inputs | {k: RawTensor(v, "float32", None) for k, v in extra.items()})


@pytest.mark.parametrize("data, field, words", [
    ([_rl([1, 2], clip_high_threshold=[0.9, 1.2])], "data[0].loss_fn_inputs.clip_high_threshold",
     ["position 0 is 0.9", ">= 1"]),
    ([_rl([1, 2], clip_low_threshold=[0.5, 1.5])], "data[0].loss_fn_inputs.clip_low_threshold",
     ["position 1 is 1.5", "[0, 1]"]),
    ([d([1, 2], targets=[1.5, 2])], "data[0].loss_fn_inputs.target_tokens", ["1.5"]),
    ([d([1, 2], targets=[-1, 2])], "data[0].loss_fn_inputs.target_tokens", ["-1"]),
])
def test_rl_inputs_are_checked_at_the_edge(data, field, words):
    e = err(data, "ppo" if "clip" in field else "cross_entropy")
    assert e.field == field
    for w in words:
        assert w in e.message


def test_pass_work_parses_the_loss_config_once():
    work, n = pass_work(spec_of("ppo"), {"clip_low_threshold": 0.7, "max_staleness": 2.0}, [_rl([3, 4, 5])], LIMITS)
    assert n == 3
    assert work == PassWork("ppo", LossConfig(clip_low_threshold=0.7, max_staleness=2), work.data)
    assert PassWork.from_json(work.to_json()) == work


@pytest.mark.parametrize("config, field", [
    ({"clip_ratio": 0.2}, "loss_fn_config.clip_ratio"),
    ({"current_policy_version": 3}, "loss_fn_config.current_policy_version"),
    ({"beta": math.inf}, "loss_fn_config.beta"),
    ({"clip_low_threshold": 1.3}, "loss_fn_config.clip_low_threshold"),
    ([1, 2], "loss_fn_config"),
])
def test_a_bad_loss_config_is_a_400_naming_the_key(config, field):
    with pytest.raises(InvalidInput) as info:
        pass_work(spec_of("ppo"), config, [_rl([3, 4])], LIMITS)
    assert info.value.field == field and info.value.status_code == 400

