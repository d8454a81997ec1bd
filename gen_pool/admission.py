"""Which sampling work enters the engine next: a pure function over a snapshot of the queue.

The worker (and bench/genpool_sim.py) build a `PoolView` — every unfinished group with its tenant,
size, progress and deadline, plus the engine's concurrency target — and call `plan_admission`,
which answers what to start and what to abort. No I/O, no clock: `now` is part of the view, so the
same function is tested with tables and driven by a discrete-event simulation.

Vocabulary: a *group* is one `sample(n)` request (a GRPO group); it is admitted sequence by
sequence (one engine slot each) and completes when all n sequences finish. A tenant's *pending
batch* is all its unfinished groups: the trainer step it waits for can start only when every one
of them is done.

The plan is built from small rules, each a function below:

1. `expired_or_cancelled`: a group past its deadline, or cancelled, is aborted (queued or running)
   and reported as such; nothing is dropped silently.
2. Free slots go first to the tenant whose pending batch is closest to complete (fewest sequences
   not yet started), so finished rollouts turn into trainable batches soonest; ties by arrival.
   Within a tenant, groups run in arrival order, a whole group at a time where it fits. Shortest
   remaining batch first keeps synchronous RL tenants cycling fastest: a tenant back from its
   trainer step with a full batch lets the others' nearly done batches start first.
3. `behind`, the guard on rule 2, without a time constant: a tenant that has held fewer
   slot-seconds since its pending batch began than its `fair_shares` slice of the capacity
   elapsed since then (`received` < share x (now - `since`)) is served first while it runs below
   its slice. A tenant that filled others' gaps has a surplus and waits its turn under rule 2; one
   back from its trainer step to a pool busy with others' tails falls behind once the grace below
   has passed unserved, and gets its slice. The guard it replaces waited a fixed `share_after_s`,
   whose right value depended on the workload's time scale (bench/genpool_sweep.py: 10 s let a
   large-batch tenant's p95 time-to-batch reach 1.8x its partition; 1 s suited this machine's
   lengths, not a GPU's); this rule asks only what the tenant got against what it was owed.
   The slice is today's (tenants present now), applied to the whole batch so far; the first
   `GRACE_SEQUENCES` mean sequence times of a batch are not owed (`grace_s`).
4. `tenant_caps`: no tenant runs more sequences than its cap (a static partition is the cap =
   target / tenants).
5. Work conservation: while any slot is free and any eligible sequence waits, it is admitted.
6. Feedback levels (a multi-level feedback queue for multi-turn episodes): a group carries its
   episode's `level` (gen_pool.episodes: demoted by the tokens the episode has consumed, raised
   by waiting and by the client's hints). Lower levels go first, within a tenant and, after rule
   3 and before rule 2, across tenants; groups without an episode are level 0, so single-turn
   work is unchanged.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

AbortReason = Literal["deadline", "cancelled"]

# Rule 3 owes a batch nothing for its first GRACE_SEQUENCES mean sequence times (measured by the
# caller over recent sequences): time for the tails already running to finish and free their slots,
# where rule 2 gains. A count of the workload's own sequences, so the rule does not change with
# the engine's speed. bench/genpool_sweep.py, workloads of 120 meeting both targets: 2 with no
# grace, 7 with 1, 10 with 2 (7 with the 1 s guard it replaced), none with a tenant's p95 past 1.1x
# its partition; 4 reaches 15 but lets 9 workloads' tenants pass 1.1x, 8 lets 17.
GRACE_SEQUENCES = 2.0


@dataclass(frozen=True)
class GroupView:
    """One unfinished sample(n) request as admission sees it."""

    request_id: str
    tenant_id: str
    arrival: float  # seconds, same clock as PoolView.now
    n_total: int  # sequences in the group (num_samples)
    n_admitted: int = 0  # sequences started (running or finished)
    n_finished: int = 0  # sequences done
    deadline: float | None = None  # absolute time; None = none
    ready: bool = True  # False while its adapter is still being loaded
    cancelled: bool = False
    level: int = 0  # feedback level of its episode (gen_pool.episodes): lower levels go first

    @property
    def waiting(self) -> int:
        """Sequences not started yet."""
        return self.n_total - self.n_admitted

    @property
    def running(self) -> int:
        return self.n_admitted - self.n_finished


@dataclass(frozen=True)
class PoolView:
    """A snapshot of one pool: its target and every unfinished group."""

    now: float
    target: int  # sequences the engine should be running
    groups: Sequence[GroupView]
    tenant_caps: Mapping[str, int] = field(default_factory=dict)  # per tenant; missing = default_cap
    default_cap: int = 0  # 0 = no cap beyond target
    weights: Mapping[str, float] = field(default_factory=dict)  # fair-share weights; missing = 1.0
    # Rule 3, per tenant with unfinished work: when its pending batch began (same clock as now), and
    # the slot-seconds its sequences have held since (running ones counted up to now). A tenant
    # missing from `since` is never behind.
    since: Mapping[str, float] = field(default_factory=dict)
    received: Mapping[str, float] = field(default_factory=dict)
    # Rule 3's grace: elapsed time not yet owed to a batch (GRACE_SEQUENCES of the pool's recent
    # mean sequence time, from the caller, which measures it).
    grace_s: float = 0.0


@dataclass(frozen=True)
class Admit:
    request_id: str
    count: int  # sequences of this group to start now


@dataclass(frozen=True)
class Abort:
    request_id: str
    reason: AbortReason


@dataclass(frozen=True)
class AdmissionPlan:
    admits: tuple[Admit, ...] = ()
    aborts: tuple[Abort, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.admits and not self.aborts

    def admitted(self, request_id: str) -> int:
        return sum(a.count for a in self.admits if a.request_id == request_id)


@dataclass
class BatchLedger:
    """Rule 3's bookkeeping, kept by whoever drives the policy (the scheduler, the simulator): per
    tenant with unfinished work, when its pending batch began and the slot-seconds its finished
    sequences have held since. Times are passed in; no clock. A tenant's batch ends when its last
    unfinished group does (`close`), and the next group it sends opens a new one."""

    since: dict[str, float] = field(default_factory=dict)
    held_s: dict[str, float] = field(default_factory=dict)

    def open(self, tenant: str, arrival: float) -> None:
        if tenant not in self.since:
            self.since[tenant], self.held_s[tenant] = arrival, 0.0

    def add(self, tenant: str, seconds: float) -> None:
        if tenant in self.held_s:
            self.held_s[tenant] += seconds

    def close(self, tenant: str) -> None:
        self.since.pop(tenant, None)
        self.held_s.pop(tenant, None)

    def received(self, running_s: Mapping[str, float]) -> dict[str, float]:
        """PoolView.received: finished sequences' slot-seconds plus `running_s` (held so far by the
        running ones) per tenant."""
        return {t: held + running_s.get(t, 0.0) for t, held in self.held_s.items()}


# --------------------------------------------------------------------------- rules


def expired_or_cancelled(view: PoolView) -> tuple[Abort, ...]:
    """Rule 1: groups to abort, cancellation before deadline when both apply."""
    out = []
    for g in view.groups:
        if g.cancelled:
            out.append(Abort(g.request_id, "cancelled"))
        elif g.deadline is not None and view.now >= g.deadline:
            out.append(Abort(g.request_id, "deadline"))
    return tuple(out)


def running_by_tenant(groups: Sequence[GroupView]) -> dict[str, int]:
    out: dict[str, int] = {}
    for g in groups:
        out[g.tenant_id] = out.get(g.tenant_id, 0) + g.running
    return out


def fair_shares(view: PoolView, groups: Sequence[GroupView]) -> dict[str, float]:
    """Rule 3's slices: the target split by weight among tenants with unfinished work."""
    active = {g.tenant_id for g in groups if g.waiting > 0 or g.running > 0}
    total = sum(view.weights.get(t, 1.0) for t in active)
    if not total:
        return {}
    return {t: view.target * view.weights.get(t, 1.0) / total for t in active}


def behind(view: PoolView, shares: Mapping[str, float], tenants: set[str]) -> set[str]:
    """Rule 3: tenants that have held less than their slice of the capacity since their batch began."""
    return {t for t in tenants
            if view.received.get(t, 0.0) < shares.get(t, 0.0) * owed_s(view, t)}


def owed_s(view: PoolView, tenant: str) -> float:
    """Seconds of its slice a tenant's pending batch is owed: since it began, less the grace."""
    return max(0.0, view.now - view.since.get(tenant, view.now) - view.grace_s)


def tenant_caps(view: PoolView, tenants: set[str]) -> dict[str, int]:
    """Rule 4: each tenant's cap on running sequences (never above the target)."""
    caps = {}
    for t in tenants:
        cap = view.tenant_caps.get(t, view.default_cap)
        caps[t] = min(cap, view.target) if cap > 0 else view.target
    return caps


# --------------------------------------------------------------------------- the plan


def plan_admission(view: PoolView) -> AdmissionPlan:
    """What to start and what to abort now (see the module docstring for the rules)."""
    aborts = expired_or_cancelled(view)
    gone = {a.request_id for a in aborts}
    live = [g for g in view.groups if g.request_id not in gone]
    running = running_by_tenant(live)
    free = view.target - sum(running.values())
    if free <= 0:
        return AdmissionPlan((), aborts)

    # Per-tenant queues of admissible groups, by feedback level, then in arrival order.
    queues: dict[str, list[GroupView]] = {}
    for g in sorted((g for g in live if g.ready and g.waiting > 0), key=lambda g: (g.level, g.arrival, g.request_id)):
        queues.setdefault(g.tenant_id, []).append(g)
    if not queues:
        return AdmissionPlan((), aborts)

    shares = fair_shares(view, live)
    owed = behind(view, shares, set(queues))
    caps = tenant_caps(view, set(queues) | set(running))
    remaining = {t: sum(g.waiting for g in q) for t, q in queues.items()}  # unstarted work per tenant
    heads = dict.fromkeys(queues, 0)  # index of the next group per tenant
    order = {t: i for i, t in enumerate(queues)}  # final tie-break: who queued first
    taken: dict[str, int] = {}  # request_id -> sequences admitted in this plan
    admits: list[Admit] = []

    def key(t: str) -> tuple:
        # A tenant behind on its slice goes first only while it runs below it.
        first = t in owed and running.get(t, 0) < shares.get(t, 0.0)
        head = queues[t][heads[t]]
        return (0 if first else 1, head.level, remaining[t], head.arrival, order[t])

    # Admitting from a tenant changes only that tenant's key, so a heap of tenants stays valid:
    # pop the best, admit its next group (or as much of it as fits), push it back with its new key.
    heap = [(key(t), t) for t in queues if running.get(t, 0) < caps[t]]
    heapq.heapify(heap)
    while free > 0 and heap:
        _, t = heapq.heappop(heap)
        g = queues[t][heads[t]]
        already = taken.get(g.request_id, 0)
        count = min(g.waiting - already, free, caps[t] - running.get(t, 0))
        taken[g.request_id] = already + count
        admits.append(Admit(g.request_id, count))
        running[t] = running.get(t, 0) + count
        remaining[t] -= count
        free -= count
        if taken[g.request_id] == g.waiting:
            heads[t] += 1
        if heads[t] < len(queues[t]) and running[t] < caps[t]:
            heapq.heappush(heap, (key(t), t))
    return AdmissionPlan(_merge(admits), aborts)


def _merge(admits: list[Admit]) -> tuple[Admit, ...]:
    """One Admit per group, in first-admitted order."""
    totals: dict[str, int] = {}
    for a in admits:
        totals[a.request_id] = totals.get(a.request_id, 0) + a.count
    return tuple(Admit(rid, n) for rid, n in totals.items())
