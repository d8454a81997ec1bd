"""Pricing is a pure function of units and a price-book entry: integer micro-USD, rounded half up
per unit and per request."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from billing.budgets import BudgetState, _states, first_exhausted, refusal
from billing.pricing import (
    Price,
    Units,
    cost_of,
    div_round_half_up,
    estimate,
    inflight_cost,
    parse_usd,
    price_at,
    training_units,
    unit_cost,
    usd,
)

JAN = datetime(2026, 1, 1, tzinfo=UTC)
JUL = datetime(2026, 7, 1, tzinfo=UTC)
Q8B = Price("Qwen/Qwen3-8B", JAN, 195_000, 600_000, 440_000, id=1)


def test_round_half_up():
    assert div_round_half_up(5, 10) == 1
    assert div_round_half_up(4, 10) == 0
    assert div_round_half_up(15, 10) == 2
    assert div_round_half_up(0, 10) == 0
    with pytest.raises(ValueError):
        div_round_half_up(-1, 10)


@pytest.mark.parametrize("tokens,rate,micro", [
    (1_000_000, 195_000, 195_000),  # exactly the rate
    (1, 500_000, 1),                # 0.5 rounds up
    (1, 499_999, 0),                # 0.499999 rounds down
    (3, 195_000, 1),                # 0.585
    (0, 600_000, 0),
    (12_345_678, 440_000, 5_432_098),  # 5432098.32
])
def test_unit_cost(tokens, rate, micro):
    assert unit_cost(tokens, rate) == micro


def test_cost_is_the_sum_of_separately_rounded_units():
    cost = cost_of(Units(prefill_tokens=3, sample_tokens=3, train_tokens=3), Q8B)
    assert (cost.prefill_micro_usd, cost.sample_micro_usd, cost.train_micro_usd) == (1, 2, 1)
    assert cost.total_micro_usd == 4


def test_no_price_costs_nothing():
    assert cost_of(Units(train_tokens=10**9), None).total_micro_usd == 0


def test_anchor_rates_per_million_tokens():
    million = Units(1_000_000, 1_000_000, 1_000_000)
    cost = cost_of(million, Q8B)
    assert (usd(cost.prefill_micro_usd), usd(cost.sample_micro_usd), usd(cost.train_micro_usd)) == \
        ("0.195000", "0.600000", "0.440000")


def test_estimate_rounds_once_over_the_run():
    # 3 train tokens per step at 0.44/M: 1.32 micro-USD per step; 100 steps = 132, not 100 x 1
    assert estimate(Units(train_tokens=3), 100, Q8B).total_micro_usd == 132


def test_units_refuse_negative_and_non_int():
    with pytest.raises(ValueError):
        Units(train_tokens=-1)
    with pytest.raises(ValueError):
        Units(prefill_tokens=1.5)


def test_price_at_picks_the_entry_in_force():
    later = Price("Qwen/Qwen3-8B", JUL, 100_000, 300_000, 200_000, id=2)
    other = Price("Qwen/Qwen3-4B", JAN, 1, 1, 1, id=3)
    book = [later, Q8B, other]
    assert price_at(book, "Qwen/Qwen3-8B", datetime(2026, 3, 1, tzinfo=UTC)) is Q8B
    assert price_at(book, "Qwen/Qwen3-8B", JUL) is later
    assert price_at(book, "Qwen/Qwen3-8B", datetime(2025, 1, 1, tzinfo=UTC)) is None
    assert price_at(book, "nope", JUL) is None


def test_training_units():
    assert training_units("forward_backward", 7) == Units(train_tokens=7)
    assert training_units("forward", 7) == Units(prefill_tokens=7)
    for kind in ("create_model", "optim_step", "save_weights", "load_weights"):
        assert training_units(kind, 0).empty


def test_inflight_cost_is_an_upper_bound_for_unknown_kinds():
    assert inflight_cost("forward_backward", 1_000_000, Q8B, 0) == 440_000
    assert inflight_cost("forward", 1_000_000, Q8B, 0) == 195_000
    assert inflight_cost("sample", 1_000_000, Q8B, 0) == 600_000  # the model's highest rate
    assert inflight_cost("sample", 1_000_000, None, 2_400_000) == 2_400_000  # the book's highest
    assert inflight_cost("forward_backward", 0, Q8B, 0) == 0


def test_usd_text_round_trips():
    assert usd(0) == "0.000000"
    assert usd(1_234_567) == "1.234567"
    assert parse_usd("1.234567") == 1_234_567
    assert parse_usd("25") == 25_000_000
    assert parse_usd("0.0000005") == 1  # half a micro-USD rounds up
    for bad in ("-1", "nan", "abc", "inf"):
        with pytest.raises(ValueError):
            parse_usd(bad)


def test_budget_counts_in_flight_work():
    state = BudgetState("tenant", limit_micro_usd=100, spent_micro_usd=60, inflight_micro_usd=39)
    assert not state.exhausted and state.remaining_micro_usd == 1
    assert BudgetState("tenant", 100, 60, 40).exhausted
    assert BudgetState("key", 0, 0, 0, "key-1", "tml-abc").exhausted  # a zero budget stops paid work


def test_tenant_budget_is_named_before_a_key_budget():
    key = BudgetState("key", 10, 20, 0, "key-1", "tml-abcdefgh")
    tenant = BudgetState("tenant", 10, 20, 0)
    assert first_exhausted([key, tenant]) is tenant
    assert first_exhausted([key]) is key
    assert first_exhausted([BudgetState("tenant", 10, 1, 1)]) is None


def test_refusal_names_budget_spend_and_remedy():
    err = refusal(BudgetState("key", 5_000_000, 4_500_000, 600_000, "key-1", "tml-abcdefgh"), "acme", "2026-07")
    assert err.status_code == 402 and err.category == "user"
    text = str(err)
    assert "API key tml-abcdefgh..." in text and "2026-07" in text
    assert "$4.500000 spent" in text and "$0.600000 in flight" in text and "$5.000000" in text
    assert "quilt budgets set acme --key tml-abcdefgh --usd" in text
    assert "quilt budgets set acme --usd" in str(refusal(BudgetState("tenant", 1, 1, 0), "acme", "2026-07"))


def test_budget_states_split_spend_and_in_flight_by_key():
    budgets = [{"api_key_id": None, "prefix": None, "monthly_limit_micro_usd": 1000},
               {"api_key_id": "k1", "prefix": "tml-k1", "monthly_limit_micro_usd": 44_056}]
    spent = [{"api_key_id": "k1", "spent": 50}, {"api_key_id": "k2", "spent": 500}]
    inflight = [{"kind": "forward_backward", "api_key_id": "k1", "n_tokens": 100_000, "base_model": "Qwen/Qwen3-8B"},
                {"kind": "sample", "api_key_id": "k2", "n_tokens": 1_000, "base_model": None}]
    tenant, key = _states(budgets, spent, inflight, {"Qwen/Qwen3-8B": Q8B})
    # 100,000 train tokens at 0.44/M = 44,000; the unpriced sample at the book's top rate (0.6/M) = 600
    assert (tenant.spent_micro_usd, tenant.inflight_micro_usd) == (550, 44_600)
    assert (key.spent_micro_usd, key.inflight_micro_usd) == (50, 44_000)
    assert not key.exhausted and key.remaining_micro_usd == 6


# ---------------------------------------------------------------------------------- context tiers

TIERS = ((32_768, 150), (131_072, 200))


@pytest.mark.parametrize("context,tiers,percent", [
    (None, TIERS, 100),  # no context (sampling, storage, a model from before contexts were chosen)
    (4_096, TIERS, 100),
    (32_768, TIERS, 100),  # a tier charges contexts above its tokens, not at them
    (32_769, TIERS, 150),
    (131_072, TIERS, 150),
    (131_073, TIERS, 200),
    (1_000_000, TIERS, 200),
    (1_000_000, (), 100),  # no tiers: no change on the bill at any context
])
def test_context_percent(context, tiers, percent):
    from billing.pricing import context_percent

    assert context_percent(context, tiers) == percent


@pytest.mark.parametrize("tiers,words", [
    ([[0, 150]], "above_tokens must be >= 1"),
    ([[1000, 99]], "percent in [100"),  # a tier never discounts
    ([[1000, 10_001]], "percent in [100"),
    ([[1000, 150], [1000, 200]], "must rise"),
    ([[2000, 150], [1000, 200]], "must rise"),
    ([[1000, 200], [2000, 150]], "never fall"),
    ([[1000]], "pair"),
    ([[1000, 1.5]], "pair of integers"),
    ([[1000, True]], "pair of integers"),
    ([["1000", 150]], "pair of integers"),
    ({"above": 1000}, "list"),
    ([[i + 1, 100] for i in range(17)], "at most 16"),
])
def test_bad_context_tiers_are_refused_by_name(tiers, words):
    from billing.pricing import check_context_tiers

    with pytest.raises(ValueError) as exc:
        check_context_tiers(tiers)
    assert words in str(exc.value), str(exc.value)


def test_good_context_tiers_come_back_as_tuples():
    from billing.pricing import check_context_tiers

    assert check_context_tiers([[32_768, 150], [131_072, 200]]) == TIERS
    assert check_context_tiers([]) == ()


@pytest.mark.parametrize("units", [
    Units(train_tokens=1), Units(train_tokens=3, prefill_tokens=7), Units(prefill_tokens=1_234_567, sample_tokens=89,
                                                                          cached_tokens=5, train_tokens=999_999),
    Units(storage_byte_hours=10**12),
])
def test_percent_100_bills_exactly_what_it_did(units):
    """A model at 100 percent (no tier) is billed to the micro-USD what the rule before tiers gave."""
    before = {u: unit_cost(units.of(u), Q8B.rate(u)) for u in ("prefill", "cached", "sample", "train")}
    cost = cost_of(units, Q8B, 100)
    assert {u: cost.of(u) for u in before} == before
    assert cost == cost_of(units, Q8B)


@pytest.mark.parametrize("train,percent,micro", [
    (1_000_000, 150, 660_000),  # 440,000 x 1.5
    (1_000_000, 200, 880_000),
    (1, 150, 1),  # 0.66 micro-USD rounds up
    (1, 100, 0),  # 0.44 rounds down
    (3, 150, 2),  # 1.98
])
def test_a_context_tier_scales_every_token_rate_and_rounds_once(train, percent, micro):
    assert cost_of(Units(train_tokens=train), Q8B, percent).train_micro_usd == micro
    # storage is not a token unit: never scaled
    assert cost_of(Units(storage_byte_hours=10**12), Q8B, percent).storage_micro_usd == \
        cost_of(Units(storage_byte_hours=10**12), Q8B).storage_micro_usd


def test_inflight_cost_charges_the_context_tier():
    assert inflight_cost("forward_backward", 1_000_000, Q8B, 0, 150) == 660_000
    assert inflight_cost("forward_backward", 1_000_000, Q8B, 0) == 440_000


def test_budgets_count_inflight_training_at_its_models_context_tier():
    import dataclasses

    price = dataclasses.replace(Q8B, context_tiers=TIERS)
    rows = [{"kind": "forward_backward", "api_key_id": None, "n_tokens": 1_000_000, "base_model": Q8B.base_model,
             "context_length": context} for context in (65_536, 4_096, None)]
    [state] = _states([{"api_key_id": None, "monthly_limit_micro_usd": 10**9, "prefix": None}], [], rows,
                      {Q8B.base_model: price})
    assert state.inflight_micro_usd == 660_000 + 440_000 + 440_000
