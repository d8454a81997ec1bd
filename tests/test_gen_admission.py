"""Admission policy tables: no I/O, no engine (gen_pool.admission)."""

import pytest

from gen_pool.admission import Abort, Admit, GroupView, PoolView, fair_shares, plan_admission


def g(rid, tenant, n, *, arrival=0.0, admitted=0, finished=0, deadline=None, ready=True, cancelled=False):
    return GroupView(rid, tenant, arrival, n, admitted, finished, deadline, ready, cancelled)


# share_after_s is far beyond the waits in these tables unless a test is about the guard.
def plan(groups, *, target=8, now=10.0, caps=None, default_cap=0, weights=None, share_after_s=60.0):
    return plan_admission(PoolView(now=now, target=target, groups=groups, tenant_caps=caps or {},
                                   default_cap=default_cap, weights=weights or {}, share_after_s=share_after_s))


def test_fills_engine_to_target_across_tenants():
    p = plan([g("a1", "A", 4), g("b1", "B", 8)], target=8)
    assert sum(a.count for a in p.admits) == 8
    assert p.admitted("a1") == 4


def test_nothing_admitted_when_engine_full():
    p = plan([g("a1", "A", 8, admitted=8), g("b1", "B", 4)], target=8)
    assert p.admits == ()


@pytest.mark.parametrize(
    "groups, target, expected",
    [
        # Both tenants below their share of 2: the one whose batch is closer to complete goes first.
        ([g("a1", "A", 3, arrival=0), g("b1", "B", 1, arrival=1)], 4, [Admit("b1", 1), Admit("a1", 3)]),
        # Only 2 slots: B's whole batch (1 sequence) completes its batch; A gets the rest.
        ([g("a1", "A", 3, arrival=0), g("b1", "B", 1, arrival=1)], 2, [Admit("b1", 1), Admit("a1", 1)]),
        # Within a tenant: arrival order, whole groups first.
        ([g("a2", "A", 2, arrival=2), g("a1", "A", 2, arrival=1)], 4, [Admit("a1", 2), Admit("a2", 2)]),
    ],
)
def test_priority_order(groups, target, expected):
    assert list(plan(groups, target=target).admits) == expected


def test_shortest_remaining_batch_first_across_shares():
    # B is back from its trainer step with a full batch (9 unstarted) and runs nothing; A's batch
    # has 1 sequence left to start. A's batch completes sooner, so it goes first though A is above
    # its share: B has waited less than share_after_s.
    groups = [g("a1", "A", 6, admitted=6), g("a2", "A", 1, arrival=3), g("b1", "B", 9, arrival=5)]
    p = plan(groups, target=8, now=6.0, share_after_s=10.0)
    assert list(p.admits) == [Admit("a2", 1), Admit("b1", 1)]


def test_starved_tenant_below_share_goes_first():
    # The same queue once B's batch has waited share_after_s: B, below its share of 4, goes first,
    # and A's single sequence waits for the next free slot.
    groups = [g("a1", "A", 6, admitted=6), g("a2", "A", 1, arrival=3), g("b1", "B", 9, arrival=5)]
    p = plan(groups, target=8, now=15.0, share_after_s=10.0)
    assert list(p.admits) == [Admit("b1", 2)]


def test_starved_tenant_precedence_ends_at_its_share():
    # Shares are 4 and 4; B runs 3 and its oldest group has waited: B's next group goes first
    # (whole, as groups are admitted), which lifts B past its share, so A's shorter batch is next.
    groups = [g("a1", "A", 2, admitted=2), g("a2", "A", 1, arrival=15), g("b1", "B", 3, admitted=3),
              g("b2", "B", 2, arrival=0), g("b3", "B", 9, arrival=1)]
    assert list(plan(groups, target=8, now=20.0, share_after_s=10.0).admits) == [Admit("b2", 2), Admit("a2", 1)]
    # Before the wait: shortest remaining batch first (A: 1 unstarted, B: 11).
    assert list(plan(groups, target=8, now=20.0).admits) == [Admit("a2", 1), Admit("b2", 2)]


def test_starvation_guard_needs_the_wait():
    # share_after_s 0 reproduces plain fair shares: below-share tenants first, whatever their work.
    groups = [g("a1", "A", 5, admitted=5), g("a2", "A", 1, arrival=9), g("b1", "B", 5, arrival=9)]
    assert list(plan(groups, target=8, now=10.0, share_after_s=0.0).admits) == [Admit("b1", 3)]
    assert list(plan(groups, target=8, now=10.0).admits) == [Admit("a2", 1), Admit("b1", 2)]


def test_gap_filling_gives_idle_tenants_slots_to_others():
    # Tenant B is between batches (nothing pending): A may use all slots.
    p = plan([g("a1", "A", 16)], target=8)
    assert p.admits == (Admit("a1", 8),)


def test_per_tenant_cap():
    p = plan([g("a1", "A", 8), g("b1", "B", 8)], target=8, caps={"A": 2})
    assert p.admitted("a1") == 2 and p.admitted("b1") == 6


def test_static_partition_is_a_cap_of_the_share():
    # (b) in bench/genpool_fill.py: each tenant capped at target / tenants; free slots stay free.
    p = plan([g("a1", "A", 8)], target=8, default_cap=4)
    assert p.admits == (Admit("a1", 4),)


def test_cap_counts_running_sequences():
    p = plan([g("a1", "A", 4, admitted=3), g("a2", "A", 4, arrival=1)], target=8, default_cap=4)
    assert p.admits == (Admit("a1", 1),)


def test_deadline_aborts_queued_and_running():
    groups = [g("q", "A", 2, deadline=5.0), g("r", "A", 2, admitted=2, deadline=9.0), g("ok", "B", 2, deadline=11.0)]
    p = plan(groups, now=10.0)
    assert set(p.aborts) == {Abort("q", "deadline"), Abort("r", "deadline")}
    assert p.admits == (Admit("ok", 2),)


def test_aborted_running_sequences_free_their_slots():
    p = plan([g("r", "A", 8, admitted=8, deadline=1.0), g("b", "B", 8)], target=8, now=2.0)
    assert p.admits == (Admit("b", 8),)


def test_cancellation_aborts():
    p = plan([g("a1", "A", 2, admitted=1, cancelled=True), g("b1", "B", 1)])
    assert p.aborts == (Abort("a1", "cancelled"),)
    assert p.admits == (Admit("b1", 1),)


def test_cancelled_wins_over_deadline():
    p = plan([g("a1", "A", 2, deadline=0.0, cancelled=True)])
    assert p.aborts == (Abort("a1", "cancelled"),)


def test_groups_not_ready_wait():
    p = plan([g("a1", "A", 2, ready=False), g("b1", "B", 2)], target=8)
    assert p.admits == (Admit("b1", 2),)


def test_partially_admitted_group_continues():
    p = plan([g("a1", "A", 10, admitted=6, finished=6)], target=8)
    assert p.admits == (Admit("a1", 4),)


def test_fair_shares_follow_weights_of_active_tenants():
    view = PoolView(now=0, target=12, groups=[], weights={"A": 2.0})
    # C has nothing pending or running, so it holds no share.
    shares = fair_shares(view, [g("a", "A", 1), g("b", "B", 1), g("c", "C", 0)])
    assert shares == {"A": 8.0, "B": 4.0}


def test_empty_view():
    assert plan([]).empty
