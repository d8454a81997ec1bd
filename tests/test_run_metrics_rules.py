"""What the trainer records per forward_backward, and the limits on what clients may post."""

from __future__ import annotations

import math

import pytest

from core.errors import InvalidInput
from core.run_metrics import MAX_NAMES, check_client_metrics, check_step, trainer_values
from core.work import Datum


def _datum(n: int, weights: list[float] | None = None) -> Datum:
    inputs = {"target_tokens": tuple(range(n))} | ({"weights": tuple(weights)} if weights is not None else {})
    return Datum(tuple(range(n)), inputs)


def test_loss_per_token_divides_by_the_weights():
    values = trainer_values([_datum(4, [0.0, 1.0, 1.0, 1.0]), _datum(2, [1.0, 1.0])],
                            {"loss:sum": 10.0, "staleness:mean": 1.0})
    assert values == {"loss:sum": 10.0, "staleness:mean": 1.0, "loss:mean": 2.0}


def test_without_weights_every_target_token_counts():
    assert trainer_values([_datum(5)], {"loss:sum": 10.0})["loss:mean"] == 2.0


def test_all_zero_weights_give_no_per_token_loss_and_nan_is_stored_as_null():
    values = trainer_values([_datum(3, [0.0, 0.0, 0.0])], {"loss:sum": math.nan})
    assert values == {"loss:sum": None}


def test_client_metrics_accept_numbers():
    assert check_client_metrics({"reward_mean": 1, "env/all/acc": 0.5}) == {"reward_mean": 1.0, "env/all/acc": 0.5}


@pytest.mark.parametrize("metrics, field, words", [
    ({f"m{i}": 1.0 for i in range(MAX_NAMES + 1)}, "metrics", "at most 64"),
    ({"r": math.nan}, "metrics.r", "finite"),
    ({"r": math.inf}, "metrics.r", "finite"),
    ({"r": "1"}, "metrics.r", "number"),
    ({"r": True}, "metrics.r", "number"),
    ({"x" * 65: 1.0}, "metrics", "64"),
    ({"<b>": 1.0}, "metrics", "letters"),
    ({"reward\n": 1.0}, "metrics", "letters"),  # a trailing newline: the name must match whole
    ({}, "metrics", "non-empty"),
    ([1.0], "metrics", "object"),
])
def test_client_metrics_errors_name_the_field_and_limit(metrics, field, words):
    with pytest.raises(InvalidInput) as exc:
        check_client_metrics(metrics)
    assert exc.value.field == field and words in exc.value.message


@pytest.mark.parametrize("step", [-1, 2**31, 1.5, "3", True])
def test_step_must_be_a_small_non_negative_int(step):
    with pytest.raises(InvalidInput) as exc:
        check_step(step)
    assert exc.value.field == "step"
