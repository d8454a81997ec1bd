"""What the public status page says, as pure functions over plain facts (tested as tables).

The route (api.routes.status) fetches the facts: whether Postgres and Redis answer, each worker's
beacon (core.health) and whether a scaler keeps it in service (scaleout.in_service), the celery
beacon, the response counts every API process publishes (api.response_tally) and the incident
notes. These functions turn them into what anyone may read: a state per component, the share of
responses that were 5xx over a few windows, and each base's recent queue waits. Nothing here
carries a host, a pid, a tenant or a queue's contents: each output field is picked by name, never
copied from a beacon wholesale, so a field a worker adds later stays off the page.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

State = Literal["up", "down", "leaving", "unknown"]
WorkerKind = Literal["trainer", "gen"]

BUCKET_S = 10  # API response counts are kept per bucket of this many seconds (api.response_tally)
WINDOWS_S = (60, 300, 900)  # the 5xx windows the page shows


@dataclass(frozen=True)
class WorkerFacts:
    """One trainer (shard) or generation worker (replica) as the stores describe it."""

    kind: WorkerKind
    name: str  # `<base>` or `<base>@<shard or replica>` (core.health.trainer_keys, gen_keys)
    base: str
    beacon: dict | None  # None: its key has expired (or was never written)
    in_service: bool  # a scaler keeps it (scaleout.in_service); configured workers all are without one


@dataclass(frozen=True)
class Component:
    id: str
    label: str
    state: State
    group: Literal["service", "stores", "workers"]

    def to_json(self) -> dict:
        return {"id": self.id, "label": self.label, "state": self.state, "group": self.group}


@dataclass(frozen=True)
class ResponseCounts:
    """Responses the API answered in one bucket, over every API process."""

    total: int = 0
    errors: int = 0  # status 500 and above


@dataclass(frozen=True)
class ErrorWindow:
    window_s: int
    responses: int
    errors: int

    @property
    def error_fraction(self) -> float | None:
        return round(self.errors / self.responses, 4) if self.responses else None

    def to_json(self) -> dict:
        return {"window_s": self.window_s, "responses": self.responses, "errors_5xx": self.errors,
                "error_fraction": self.error_fraction}


@dataclass(frozen=True)
class QueueWait:
    """The slowest live worker's recent queue waits for one side of a base."""

    p50_s: float
    p95_s: float
    requests: int  # how many recent requests the figures summarise, over the workers

    def to_json(self) -> dict:
        return {"p50_s": self.p50_s, "p95_s": self.p95_s, "requests": self.requests}


@dataclass(frozen=True)
class BaseWaits:
    base: str
    training: QueueWait | None
    sampling: QueueWait | None

    def to_json(self) -> dict:
        return {"base_model": self.base, "training": self.training and self.training.to_json(),
                "sampling": self.sampling and self.sampling.to_json()}


_KIND_LABEL = {"trainer": "Training", "gen": "Sampling"}


def _worker_label(w: WorkerFacts) -> str:
    _, _, part = w.name.partition("@")
    return f"{_KIND_LABEL[w.kind]} · {w.base}" + (f" ({part})" if part else "")


def worker_state(w: WorkerFacts, *, redis_ok: bool) -> State | None:
    """A worker's state; None when the page leaves it out (out of service and silent: a scaler
    stopped it on purpose)."""
    if not redis_ok:
        return "unknown"  # its beacon cannot be read: say so rather than call it down
    if w.in_service:
        return "up" if w.beacon is not None else "down"
    return "leaving" if w.beacon is not None else None


def components(*, postgres_ok: bool, redis_ok: bool, workers: Iterable[WorkerFacts],
               celery_beacon: dict | None) -> list[Component]:
    """Every component, in the page's order: the API (which is answering: it assembled this),
    the stores, each worker, and the upkeep scheduler."""
    out = [Component("api", "API", "up", "service"),
           Component("postgres", "Database (Postgres)", "up" if postgres_ok else "down", "stores"),
           Component("redis", "Queues (Redis)", "up" if redis_ok else "down", "stores")]
    for w in workers:
        state = worker_state(w, redis_ok=redis_ok)
        if state is not None:
            out.append(Component(f"{w.kind}:{w.name}", _worker_label(w), state, "workers"))
    upkeep: State = "unknown" if not redis_ok else ("up" if celery_beacon is not None else "down")
    out.append(Component("celery", "Upkeep (Celery)", upkeep, "service"))
    return out


def overall(parts: list[Component]) -> Literal["ok", "degraded", "down"]:
    """`down` when a store is (nothing can be admitted), `degraded` when anything else is down or
    unknown, else `ok`. A worker on its way out of service counts as up."""
    states = {c.id: c.state for c in parts}
    if states.get("postgres") == "down" or states.get("redis") == "down":
        return "down"
    return "ok" if all(c.state in ("up", "leaving") for c in parts) else "degraded"


def bucket_of(t: float) -> int:
    """The start of the bucket holding time `t` (seconds)."""
    return int(t // BUCKET_S) * BUCKET_S


def buckets_for(now: float, window_s: int) -> list[int]:
    """The buckets a window reads: the current (partial) one and those before it, `window_s /
    BUCKET_S` in all, so a 60 s window holds between 50 and 60 s of responses."""
    current = bucket_of(now)
    return [current - i * BUCKET_S for i in range(max(1, window_s // BUCKET_S))]


def error_windows(counts: Mapping[int, ResponseCounts], now: float,
                  windows_s: Iterable[int] = WINDOWS_S) -> list[ErrorWindow]:
    """The responses and 5xx answered over each window, from per-bucket counts (a missing bucket:
    none answered, or its counts expired)."""
    out = []
    for w in windows_s:
        picked = [counts.get(b, ResponseCounts()) for b in buckets_for(now, w)]
        out.append(ErrorWindow(w, sum(c.total for c in picked), sum(c.errors for c in picked)))
    return out


def _wait(beacons: list[dict]) -> QueueWait | None:
    # Shards and replicas fuse and admit apart, so the base's wait is its slowest worker's, not a
    # mean that one idle replica would halve.
    known = [b for b in beacons if isinstance(b.get("queue_wait_p95_s"), (int, float))
             and isinstance(b.get("queue_wait_p50_s"), (int, float))]
    if not known:
        return None
    return QueueWait(p50_s=max(float(b["queue_wait_p50_s"]) for b in known),
                     p95_s=max(float(b["queue_wait_p95_s"]) for b in known),
                     requests=sum(int(b.get("queue_wait_n") or 0) for b in known))


def queue_waits(workers: Iterable[WorkerFacts]) -> list[BaseWaits]:
    """Each base's recent training and sampling queue waits (from arrival to the request's work
    starting: a trainer round, a sequence entering the engine), from the live workers' beacons;
    a side with no live worker or no request yet reads None."""
    by_base: dict[str, dict[WorkerKind, list[dict]]] = {}
    for w in workers:
        sides = by_base.setdefault(w.base, {"trainer": [], "gen": []})
        if w.beacon is not None:
            sides[w.kind].append(w.beacon)
    return [BaseWaits(base, _wait(sides["trainer"]), _wait(sides["gen"])) for base, sides in by_base.items()]
