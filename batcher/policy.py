"""Round planning: a pure function from queue state to what runs next. No I/O, no torch.

A round takes, for every training model, the requests that are next in its `seq_id` order:
- a run of consecutive `forward`/`forward_backward` requests may join the fused pass (different
  models' rows share one forward and one backward over the base);
- anything else (create, optim_step, save, load) is a barrier for its own model only and runs after
  the pass; requests of that model behind it wait for the next round.
Batching never reorders one model's requests.

When the fused candidates exceed the pass's token budget, tenants share it by weighted deficit
round robin in tokens: each round every tenant with work is credited its weighted share of the
budget, requests are admitted while the tenant's credit covers them, and what is left of the budget
goes to whoever still has work (work-conserving), charged against their credit so a tenant that
took extra waits its turn next round. Credit of a tenant with nothing queued is forgotten, and
credit is bounded, so nobody can bank a burst. A request larger than the whole budget runs alone
(the backend splits it into passes and accumulates its gradients).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from core.work import WorkKind

FUSABLE = frozenset(k for k in WorkKind if k.is_pass)


@dataclass(frozen=True)
class Pending:
    request_id: str
    model_id: str
    tenant_id: str
    seq_id: int
    kind: str
    n_tokens: int


@dataclass(frozen=True)
class ModelQueue:
    model_id: str
    next_seq: int
    pending: tuple[Pending, ...]  # sorted by seq_id


@dataclass(frozen=True)
class FairShare:
    """Inputs of the fairness filter. `deficits` is the state carried from round to round."""

    token_budget: int | None = None  # model-input tokens per fused pass; None = no limit
    weights: Mapping[str, float] = field(default_factory=dict)  # tenant -> plan weight (default 1)
    deficits: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RoundPlan:
    fused: tuple[Pending, ...] = ()
    barriers: tuple[Pending, ...] = ()
    deficits: Mapping[str, float] = field(default_factory=dict)  # to pass into the next round

    @property
    def empty(self) -> bool:
        return not self.fused and not self.barriers


def runnable_prefix(queue: ModelQueue) -> tuple[Pending, ...]:
    """The requests that may run now: contiguous from `next_seq`, stopping after a barrier."""
    out: list[Pending] = []
    expect = queue.next_seq
    for p in queue.pending:
        if p.seq_id != expect:
            break
        if p.kind not in FUSABLE:
            if not out:
                out.append(p)
            break
        out.append(p)
        expect += 1
    return tuple(out)


def split_runnable(queues: list[ModelQueue]) -> tuple[dict[str, list[tuple[Pending, ...]]], list[Pending]]:
    """Runnable work as (fusable prefixes grouped by tenant, barriers)."""
    by_tenant: dict[str, list[tuple[Pending, ...]]] = {}
    barriers: list[Pending] = []
    for q in queues:
        ready = runnable_prefix(q)
        if not ready:
            continue
        if ready[0].kind in FUSABLE:
            by_tenant.setdefault(ready[0].tenant_id, []).append(ready)
        else:
            barriers.append(ready[0])
    return by_tenant, barriers


def _tenant_stream(prefixes: list[tuple[Pending, ...]]) -> list[Pending]:
    """One tenant's candidates, its models interleaved so none of them waits behind another."""
    out: list[Pending] = []
    depth = max(len(p) for p in prefixes)
    for i in range(depth):
        out.extend(p[i] for p in prefixes if i < len(p))
    return out


def fair_select(by_tenant: dict[str, list[tuple[Pending, ...]]], share: FairShare) -> tuple[list[Pending], dict[str, float]]:
    """Pick the fused requests under the token budget; returns (chosen, new deficits)."""
    streams = {t: _tenant_stream(prefixes) for t, prefixes in by_tenant.items()}
    if share.token_budget is None or sum(p.n_tokens for s in streams.values() for p in s) <= share.token_budget:
        return [p for t in sorted(streams) for p in streams[t]], {}

    budget = share.token_budget
    weight = {t: max(share.weights.get(t, 1.0), 1e-6) for t in streams}
    total_weight = sum(weight.values())
    credit = {t: share.deficits.get(t, 0.0) + budget * weight[t] / total_weight for t in streams}
    # Within a tenant, a model's requests must stay in order: a skipped request blocks the rest of
    # that model for this round.
    cursor = {t: 0 for t in streams}
    blocked: dict[str, set[str]] = {t: set() for t in streams}
    chosen: list[Pending] = []
    used = 0

    def admit(t: str, *, within_credit: bool) -> None:
        nonlocal used
        stream = streams[t]
        for i in range(cursor[t], len(stream)):
            p = stream[i]
            if p.model_id in blocked[t]:
                continue
            fits_budget = used + p.n_tokens <= budget
            fits_credit = p.n_tokens <= credit[t] or not within_credit
            if fits_budget and fits_credit:
                chosen.append(p)
                used += p.n_tokens
                credit[t] -= p.n_tokens
            else:
                blocked[t].add(p.model_id)
        cursor[t] = len(stream)

    order = sorted(streams, key=lambda t: (-credit[t], t))
    for t in order:
        admit(t, within_credit=True)
    # Work-conserving: leftover budget goes to whoever still has work, richest credit first.
    for t in sorted(streams, key=lambda t: (-credit[t], t)):
        blocked[t].clear()
        cursor[t] = 0
        streams[t] = [p for p in streams[t] if p not in chosen]
        admit(t, within_credit=False)
    if not chosen:  # one request bigger than the whole budget: it runs alone, split by the backend
        t = order[0]
        first = streams[t][0]
        chosen.append(first)
        credit[t] -= first.n_tokens
    # Forget the credit of tenants left with nothing queued; bound the rest to one budget either way.
    leftover = {p.tenant_id for s in streams.values() for p in s if p not in chosen}
    deficits = {t: max(-budget, min(budget, c)) for t, c in credit.items() if t in leftover}
    # A model's requests must still run in seq order: keep, per model, only the chosen prefix.
    return _in_seq_order(chosen, by_tenant), deficits


def _in_seq_order(chosen: list[Pending], by_tenant: dict[str, list[tuple[Pending, ...]]]) -> list[Pending]:
    picked = {p.request_id for p in chosen}
    out: list[Pending] = []
    for t in sorted(by_tenant):
        for prefix in by_tenant[t]:
            for p in prefix:
                if p.request_id not in picked:
                    break
                out.append(p)
    return out


def plan_round(queues: list[ModelQueue], share: FairShare | None = None) -> RoundPlan:
    share = share or FairShare()
    by_tenant, barriers = split_runnable(queues)
    fused, deficits = fair_select(by_tenant, share) if by_tenant else ([], {})
    return RoundPlan(tuple(fused), tuple(barriers), deficits)
