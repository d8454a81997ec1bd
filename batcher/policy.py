"""Round planning: a pure function from queue state to what runs next. No I/O, no torch.

A round takes, for every training model, the requests that are next in its `seq_id` order:
- a run of consecutive `forward`/`forward_backward` requests joins the fused pass (different
  models' rows share one forward and one backward over the base);
- anything else (create, optim_step, save, load) is a barrier for its own model only and runs after
  the pass; requests of that model behind it wait for the next round.
Batching never reorders one model's requests.
"""

from __future__ import annotations

from dataclasses import dataclass

FUSABLE = frozenset({"forward", "forward_backward"})


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
class RoundPlan:
    fused: tuple[Pending, ...] = ()
    barriers: tuple[Pending, ...] = ()

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


def plan_round(queues: list[ModelQueue]) -> RoundPlan:
    fused: list[Pending] = []
    barriers: list[Pending] = []
    for q in queues:
        ready = runnable_prefix(q)
        if not ready:
            continue
        if ready[0].kind in FUSABLE:
            fused.extend(ready)
        else:
            barriers.append(ready[0])
    return RoundPlan(tuple(fused), tuple(barriers))
