"""Feedback levels for multi-turn episodes as tables (gen_pool.episodes, admission rule 6)."""

import pytest

from gen_pool.admission import Admit, GroupView, PoolView, plan_admission
from gen_pool.episodes import EpisodeLedger, FeedbackLevels, level

CFG = FeedbackLevels(quantum_tokens=100, growth=4, levels=4, aging_s=10.0)


@pytest.mark.parametrize("consumed, expected", [(0, 0), (99, 0), (100, 1), (399, 1), (400, 2), (1599, 2),
                                                (1600, 3), (10**9, 3)])
def test_levels_follow_tokens_consumed(consumed, expected):
    assert level(consumed, 0, 0.0, CFG) == expected


@pytest.mark.parametrize("waited, expected", [(0.0, 3), (9.9, 3), (10.0, 2), (25.0, 1), (1e6, 0), (-5.0, 3)])
def test_waiting_raises_a_call_one_level_per_aging_period(waited, expected):
    assert level(10_000, 0, waited, CFG) == expected


def test_hints_shift_within_the_levels_and_aging_can_be_off():
    assert level(0, -2, 0.0, CFG) == 0  # cannot rise above the top level
    assert level(0, 2, 0.0, CFG) == 2
    assert level(10**6, 5, 0.0, CFG) == 3
    assert level(10**6, 0, 1e9, FeedbackLevels(quantum_tokens=100, aging_s=0)) == 3
    assert level(10**6, 0, 0.0, FeedbackLevels(levels=1)) == 0  # one level: off


def test_ledger_counts_per_tenant_and_episode_and_applies_hints():
    ledger = EpisodeLedger(CFG)
    ledger.hint("A", "ep", None)
    ledger.consume("A", "ep", 150)
    assert ledger.level("A", "ep", 0.0) == 1
    assert ledger.level("B", "ep", 0.0) == 0  # another tenant's episode of the same name is its own
    assert ledger.level("A", None, 0.0) == 0  # a call without an episode
    ledger.hint("A", "ep", "demote")
    assert ledger.level("A", "ep", 0.0) == 2
    for _ in range(5):
        ledger.hint("A", "ep", "promote")
    assert ledger.level("A", "ep", 0.0) == 0  # promoted past where its tokens put it, no further


def test_ledger_forgets_the_least_recent_episodes_first():
    ledger = EpisodeLedger(CFG, capacity=2)
    for name in ("e1", "e2"):
        ledger.consume("A", name, 500)
    ledger.hint("A", "e1", None)  # e1 used again: e2 is now the oldest
    ledger.consume("A", "e3", 500)
    assert len(ledger) == 2
    assert ledger.level("A", "e2", 0.0) == 0 and ledger.level("A", "e1", 0.0) == 2


def g(rid, tenant, n, *, arrival=0.0, admitted=0, level=0):
    return GroupView(rid, tenant, arrival, n, admitted, 0, level=level)


def test_lower_levels_go_first_within_a_tenant():
    groups = [g("long-turn", "A", 1, arrival=0.0, level=2), g("new", "A", 1, arrival=5.0),
              g("mid", "A", 1, arrival=1.0, level=1)]
    p = plan_admission(PoolView(now=6.0, target=2, groups=groups))
    assert list(p.admits) == [Admit("new", 1), Admit("mid", 1)]


def test_levels_order_tenants_before_shortest_remaining_batch():
    # A's head is on level 2 (its long tail) and its batch is nearly done; B's head is new work.
    groups = [g("a", "A", 1, level=2), g("b", "B", 4, arrival=1.0)]
    p = plan_admission(PoolView(now=2.0, target=2, groups=groups))
    assert list(p.admits) == [Admit("b", 2)]
    # Without levels, A's shorter remaining batch goes first, as before.
    p = plan_admission(PoolView(now=2.0, target=2, groups=[g("a", "A", 1), g("b", "B", 4, arrival=1.0)]))
    assert list(p.admits) == [Admit("a", 1), Admit("b", 1)]


def test_a_tenant_behind_on_its_slice_still_goes_first_whatever_its_level():
    groups = [g("a", "A", 1, level=3), g("b", "B", 4, arrival=1.0)]
    p = plan_admission(PoolView(now=2.0, target=2, groups=groups, since={"A": 0.0, "B": 1.0},
                                received={"A": 0.0, "B": 10.0}))
    assert list(p.admits)[0] == Admit("a", 1)


def test_the_generation_settings_default_to_the_episode_defaults():
    # core.settings cannot import gen_pool (the layers), so the defaults are written there again.
    from core.settings import GenPoolSettings
    from gen_pool.episodes import FeedbackLevels, levels_of

    assert levels_of(GenPoolSettings()) == FeedbackLevels()
