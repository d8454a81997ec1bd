"""Admission policy tables: no I/O, no engine (gen_pool.admission)."""

import pytest

from gen_pool.admission import (
    Abort,
    Admit,
    BatchLedger,
    GroupView,
    PoolView,
    fair_shares,
    plan_admission,
)


def g(rid, tenant, n, *, arrival=0.0, admitted=0, finished=0, deadline=None, ready=True, cancelled=False):
    return GroupView(rid, tenant, arrival, n, admitted, finished, deadline, ready, cancelled)


# Without `since`, no tenant is behind on its slice (rule 3) unless a test is about the guard.
def plan(groups, *, target=8, now=10.0, caps=None, default_cap=0, weights=None, since=None, received=None):
    return plan_admission(PoolView(now=now, target=target, groups=groups, tenant_caps=caps or {},
                                   default_cap=default_cap, weights=weights or {}, since=since or {},
                                   received=received or {}))


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
    # B is back from its trainer step with a full batch (9 unstarted) the moment this plan is made,
    # and A's batch has 1 sequence left to start. A's batch completes sooner, so it goes first though
    # A is above its share: no capacity has elapsed since B's batch began, so B is owed nothing yet.
    groups = [g("a1", "A", 6, admitted=6), g("a2", "A", 1, arrival=3), g("b1", "B", 9, arrival=6)]
    p = plan(groups, target=8, now=6.0, since={"A": 0.0, "B": 6.0}, received={"A": 36.0, "B": 0.0})
    assert list(p.admits) == [Admit("a2", 1), Admit("b1", 1)]


def test_tenant_behind_on_its_slice_goes_first():
    # The same queue half a second later, B still unserved: it has held 0 of the 4 x 0.5 slot-seconds
    # its slice (4 of 8) was owed, so B goes first, and A's single sequence waits for the next slot.
    groups = [g("a1", "A", 6, admitted=6), g("a2", "A", 1, arrival=3), g("b1", "B", 9, arrival=6)]
    p = plan(groups, target=8, now=6.5, since={"A": 0.0, "B": 6.0}, received={"A": 39.0, "B": 0.0})
    assert list(p.admits) == [Admit("b1", 2)]


def test_a_tenant_with_a_surplus_is_not_behind():
    # A's tail runs below its slice, but it held far more than its slice while B was away
    # (received 60 of 4 x 10 owed): A is not behind, so B (behind) goes first; with A behind too,
    # both are in the first tier and the shorter batch (A's) leads.
    groups = [g("a1", "A", 3, admitted=3), g("a2", "A", 1, arrival=3), g("b1", "B", 9, arrival=9)]
    since = {"A": 0.0, "B": 9.0}
    assert list(plan(groups, now=10.0, since=since, received={"A": 60.0, "B": 0.0}).admits) == [
        Admit("b1", 5)]
    assert list(plan(groups, now=10.0, since=since, received={"A": 20.0, "B": 0.0}).admits) == [
        Admit("a2", 1), Admit("b1", 4)]


def test_behind_tenant_precedence_ends_at_its_share():
    # Shares are 4 and 4; B runs 3 and is behind: B's next group goes first (whole, as groups are
    # admitted), which lifts B past its share, so A's shorter batch is next.
    groups = [g("a1", "A", 2, admitted=2), g("a2", "A", 1, arrival=15), g("b1", "B", 3, admitted=3),
              g("b2", "B", 2, arrival=0), g("b3", "B", 9, arrival=1)]
    since, received = {"A": 15.0, "B": 0.0}, {"A": 30.0, "B": 30.0}
    assert list(plan(groups, now=20.0, since=since, received=received).admits) == [Admit("b2", 2), Admit("a2", 1)]
    # B caught up (80 slot-seconds held of 4 x 20 owed): shortest remaining batch first (A: 1, B: 11).
    assert list(plan(groups, now=20.0, since=since, received={"A": 30.0, "B": 80.0}).admits) == [
        Admit("a2", 1), Admit("b2", 2)]


def test_slices_follow_weights():
    # B's weight 3 makes its slice 6 of 8: 20 slot-seconds over 5 s is behind 6 x 5 but would not be
    # behind an equal slice of 4 x 5.
    groups = [g("a1", "A", 2, admitted=2), g("a2", "A", 1, arrival=3), g("b1", "B", 9, arrival=5)]
    since, received = {"A": 0.0, "B": 5.0}, {"A": 20.0, "B": 20.0}
    assert list(plan(groups, now=10.0, since=since, received=received, weights={"B": 3.0}).admits)[0].request_id == "b1"
    assert list(plan(groups, now=10.0, since=since, received=received).admits)[0].request_id == "a2"


def test_ledger_opens_accrues_and_closes_a_batch():
    ledger = BatchLedger()
    ledger.open("A", 2.0)
    ledger.open("A", 5.0)  # a later group of the same batch does not restart it
    ledger.add("A", 1.5)
    ledger.add("B", 9.0)  # no open batch: nothing to accrue to
    assert ledger.since == {"A": 2.0}
    assert ledger.received({"A": 0.5}) == {"A": 2.0}
    ledger.close("A")
    ledger.open("A", 7.0)
    assert ledger.since == {"A": 7.0} and ledger.received({}) == {"A": 0.0}


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
