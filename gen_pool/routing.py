"""Which generation replica takes a sample group: a pure function over the replicas' state.

With several generation replicas per base model, a group should go where its adapter is already
resident (loading one costs a slot and time), where its prompt's prefix is likely cached, where
its episode's previous turn ran (its KV is there), and not where the queue is long. `route` scores
the candidates it is given on exactly these and picks the best; the caller (a router process, or
bench/genpool_route_sim.py) keeps the replica views current and passes the candidates.

How this differs from llm-d's scheduler (filter, then weighted scorers: queue depth, KV-cache
use, prefix cache, running requests, LoRA affinity, session affinity):
* the unit is a sample(n) group, not a request: its n sequences share one prompt, so they go to
  one replica together and the prompt is prefilled once there;
* load is sequences (running and queued) against the replica's own concurrency target, the number
  Quilt's admission keeps running, not a request count; a hard filter first drops replicas that
  this group would push past (1 + `overload`) x target, unless every replica is past it (bounded
  load, so affinity never piles a hot adapter's tenants onto one replica);
* adapter affinity has three tiers: resident in an engine slot, in the replica's CPU cache (cheap
  to activate), elsewhere (a load from the checkpoint store);
* the episode affinity key is Quilt's `episode_id` (gen_pool.episodes), sent with the call.
Fairness is not the router's: each replica's admission (gen_pool.admission) still shares its
slots among the tenants it holds.

Candidates: at scale the caller passes the replicas that hold the adapter plus a few sampled
others (power of d choices), so routing a group costs O(holders + d), not O(replicas).
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

# A prompt's prefix is its first this many tokens: a GRPO group's prompt, or a multi-turn
# episode's shared system prompt and first turns, usually agree that far.
PREFIX_TOKENS = 32
POLICIES = ("affinity", "round_robin", "random")
Policy = Literal["affinity", "round_robin", "random"]


@dataclass(frozen=True)
class ReplicaView:
    name: str
    running: int  # sequences running
    waiting: int  # sequences queued there, not yet started
    target: int  # its concurrency target
    adapters: frozenset[str] = frozenset()  # resident in an engine slot
    cached_adapters: frozenset[str] = frozenset()  # in its CPU cache
    prefixes: frozenset[int] = frozenset()  # prompt-prefix hashes it served recently
    sessions: frozenset[str] = frozenset()  # episode ids it served recently
    healthy: bool = True


@dataclass(frozen=True)
class RouteRequest:
    n: int  # sequences in the group
    adapter: str | None = None  # None: the base model
    prefix: int | None = None  # hash of the prompt's leading block
    session: str | None = None  # episode id


@dataclass(frozen=True)
class RouteWeights:
    adapter: float = 3.0
    cached_adapter: float = 1.0
    prefix: float = 1.0
    session: float = 2.0
    load: float = 2.0  # per unit of (running + waiting) / target
    overload: float = 0.5  # bounded load: past (1 + this) x target a replica is filtered out


def load(r: ReplicaView, n: int = 0) -> float:
    return (r.running + r.waiting + n) / max(r.target, 1)


def score(req: RouteRequest, r: ReplicaView, w: RouteWeights) -> float:
    s = -w.load * load(r, req.n)
    if req.adapter is not None:
        s += w.adapter if req.adapter in r.adapters else (w.cached_adapter if req.adapter in r.cached_adapters else 0.0)
    if req.prefix is not None and req.prefix in r.prefixes:
        s += w.prefix
    if req.session is not None and req.session in r.sessions:
        s += w.session
    return s


def route(req: RouteRequest, replicas: Sequence[ReplicaView], w: RouteWeights = RouteWeights()) -> int | None:  # noqa: B008
    """The index (into `replicas`) of the replica to send `req` to; None when none is healthy.
    Ties go to the lower index, so the answer is deterministic."""
    live = [i for i, r in enumerate(replicas) if r.healthy]
    if not live:
        return None
    fits = [i for i in live if load(replicas[i], req.n) <= 1 + w.overload] or live
    return max(fits, key=lambda i: (score(req, replicas[i], w), -i))


def stable_hash(text: str) -> int:
    """A 53-bit number, the same in every process (Python's `hash` of a str is not), and exact
    through JSON readers that hold numbers as doubles."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 11


def prefix_hash(prompt: Sequence[int]) -> int:
    """`stable_hash` of a prompt's leading PREFIX_TOKENS tokens."""
    return stable_hash(",".join(map(str, prompt[:PREFIX_TOKENS])))


def view_of(name: str, beacon: Mapping | None) -> ReplicaView:
    """A replica as its health beacon describes it; no beacon (expired): unhealthy."""
    if beacon is None:
        return ReplicaView(name, 0, 0, 1, healthy=False)
    return ReplicaView(name, int(beacon.get("running", 0)), int(beacon.get("waiting", 0)),
                       int(beacon.get("target", 1)), frozenset(beacon.get("adapters") or ()),
                       frozenset(beacon.get("cached_adapters") or ()), frozenset(beacon.get("prefixes") or ()),
                       frozenset(beacon.get("sessions") or ()))


def pick(policy: Policy, req: RouteRequest, replicas: Sequence[ReplicaView], *, turn: int = 0,
         rng: random.Random | None = None) -> int | None:
    """`route` under `policy`, or one of its baselines among the healthy replicas: round-robin
    (the `turn`-th, a counter the caller keeps) or uniformly at random."""
    if policy == "affinity":
        return route(req, replicas)
    live = [i for i, r in enumerate(replicas) if r.healthy]
    if not live:
        return None
    return live[turn % len(live)] if policy == "round_robin" else (rng or random).choice(live)


class Recent:
    """The last `size` distinct keys used, least recent first (what a replica reports it holds)."""

    def __init__(self, size: int):
        self.size = size
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def touch(self, key: Hashable) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.size:
            self._keys.popitem(last=False)

    def last(self, n: int) -> list:
        """The `n` most recent, least recent first."""
        out = [k for _, k in zip(range(n), reversed(self._keys))]
        return out[::-1]

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator:
        return iter(self._keys)
