"""Prompt tokens are checked at the edge (gen_pool.params): anything but an integer token id in the
vocabulary is a 400 naming the position, including NaN and Infinity (issue 14, cause 3)."""

from __future__ import annotations

import math

import pytest

from core.errors import InvalidInput
from gen_pool.params import Limits, check_prompt

LIMITS = Limits(vocab_size=100, max_context_length=16, max_samples=8, max_new_tokens=8, default_max_tokens=4,
                max_stop_entries=4, max_stop_chars=16)


@pytest.mark.parametrize("token", [math.nan, math.inf, -math.inf, 1.5, "3", True, None, 2**70, -1, 100])
def test_a_bad_prompt_token_is_a_400_naming_it(token):
    with pytest.raises(InvalidInput) as info:
        check_prompt([1, token], LIMITS)
    assert info.value.field == "prompt" and "token 1" in info.value.message


def test_integral_floats_are_token_ids():
    assert check_prompt([1, 2.0, 99], LIMITS) == [1, 2, 99]
