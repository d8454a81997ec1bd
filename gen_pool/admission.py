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
3. `long_waiting`, the guard on rule 2: a tenant below its `fair_shares` slice of the target
   (split by weight among tenants with unfinished work) whose oldest unstarted group has waited
   `share_after_s` is served first. Without it a tenant with large batches under load falls
   behind what its own static partition would give it (bench/genpool_sweep.py: p95 time-to-batch
   up to 1.8x with a 10 s guard, never above 1.1x with 1 s); a short guard keeps most of rule 2's
   gain, because the moment a tenant returns is when the others' tails compete with its batch.
4. `tenant_caps`: no tenant runs more sequences than its cap (a static partition is the cap =
   target / tenants).
5. Work conservation: while any slot is free and any eligible sequence waits, it is admitted.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

AbortReason = Literal["deadline", "cancelled"]


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
    share_after_s: float = 1.0  # rule 3: waiting this long puts a tenant below its share first


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


def long_waiting(view: PoolView, queues: Mapping[str, Sequence[GroupView]]) -> set[str]:
    """Rule 3: tenants whose oldest unstarted group has waited `share_after_s` (queues in arrival order)."""
    return {t for t, q in queues.items() if view.now - q[0].arrival >= view.share_after_s}


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

    # Per-tenant queues of admissible groups, in arrival order.
    queues: dict[str, list[GroupView]] = {}
    for g in sorted((g for g in live if g.ready and g.waiting > 0), key=lambda g: (g.arrival, g.request_id)):
        queues.setdefault(g.tenant_id, []).append(g)
    if not queues:
        return AdmissionPlan((), aborts)

    shares = fair_shares(view, live)
    waited = long_waiting(view, queues)
    caps = tenant_caps(view, set(queues) | set(running))
    remaining = {t: sum(g.waiting for g in q) for t, q in queues.items()}  # unstarted work per tenant
    heads = dict.fromkeys(queues, 0)  # index of the next group per tenant
    order = {t: i for i, t in enumerate(queues)}  # final tie-break: who queued first
    taken: dict[str, int] = {}  # request_id -> sequences admitted in this plan
    admits: list[Admit] = []

    def key(t: str) -> tuple:
        # A long-waiting tenant goes first only while it is below its share.
        first = t in waited and running.get(t, 0) < shares.get(t, 0.0)
        return (0 if first else 1, remaining[t], queues[t][heads[t]].arrival, order[t])

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
