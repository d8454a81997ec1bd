"""Sending sample groups to generation replicas (QUILT_GEN_REPLICAS above 1), and taking a dead
replica's groups back. The policy is gen_pool.routing's; this module only moves data to and from it.

    API       `Router.stream_for(redis, base, item)`: the replica stream a group is appended to
    workers   `reroute_dead_peers(redis, base, me, ...)`: a replica whose consumer liveness key has
              lapsed (QUILT_GEN_TAKEOVER_S) is dead; its Postgres sessions are ended and its
              queued and in-flight groups moved, each once (core.queue.move), to live replicas
              by the same policy

Replicas describe themselves in their health beacons (core.health.gen_key(base, name)) as their
load changes (at most every 0.2 s): running and queued sequences, target, the adapters in their
engine slots and CPU cache, the prompt prefixes and episodes they served lately (`Locality`). The
API reads them at most every REFRESH_S and adds what it sent each replica after that replica's
beacon was taken (remembered REMEMBER_S), so neither a burst between two reads nor a beacon that
lags its replica sends a tenant's groups off the replica holding its adapter. With no beacon yet (replicas still starting) a group
goes to a replica fixed by its adapter (or prompt), so one tenant's groups still land together.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from collections import deque
from collections.abc import Sequence
from typing import cast

from core import db, health, queue
from core.work import MalformedWork, SampleWork, WorkItem
from gen_pool.routing import (
    Policy,
    Recent,
    ReplicaView,
    RouteRequest,
    pick,
    prefix_hash,
    stable_hash,
    view_of,
)
from scaleout import in_service

log = logging.getLogger("quilt.gen.router")

REFRESH_S = 0.2
REMEMBER_S = 10.0  # what the API sent a replica counts into its view this long (beacons lag a few seconds)
RECENT = 256  # prefixes and episodes a replica's beacon lists


def route_request(work: SampleWork) -> RouteRequest:
    return RouteRequest(n=work.n, adapter=work.adapter.key if work.adapter else None, prefix=prefix_hash(work.prompt),
                        session=work.episode_id)


def routed(view: ReplicaView, req: RouteRequest, *, load: bool = True) -> ReplicaView:
    """`view` after `req` was sent there: its sequences queued (unless not `load`), its adapter,
    prefix and episode held."""
    return dataclasses.replace(
        view, waiting=view.waiting + (req.n if load else 0),
        adapters=view.adapters | {req.adapter} if req.adapter else view.adapters,
        prefixes=view.prefixes | {req.prefix} if req.prefix is not None else view.prefixes,
        sessions=view.sessions | {req.session} if req.session else view.sessions)


def fallback(req: RouteRequest, count: int) -> int:
    """The replica for a group when none has said anything yet: fixed by adapter, else by prompt."""
    return (stable_hash(req.adapter) if req.adapter else (req.prefix or 0)) % count


def read_beacons(raws: Sequence[bytes | str | None]) -> list[dict | None]:
    """Beacons as dicts, the routing figures (under "routing") beside the load figures."""
    out: list[dict | None] = []
    for raw in raws:
        beacon = json.loads(raw) if raw else None
        out.append(None if beacon is None else {**beacon, **(beacon.get("routing") or {})})
    return out


class Router:
    """One API process's router: per base model, the replicas' last beacons, what it sent each
    replica since (which the next beacons may not show yet), and a round-robin turn."""

    def __init__(self, replicas: int, policy: Policy, *, clock=time.time, rng: random.Random | None = None):
        self.names = queue.replica_names(replicas)
        self.policy = policy
        self.clock = clock  # wall time: beacons carry theirs
        self.rng = rng or random.Random()
        self._views: dict[str, tuple[float, list[ReplicaView]]] = {}
        self._serving: dict[str, int] = {}  # per base, the replicas in service (scaleout.in_service)
        self._sent: dict[str, deque[tuple[float, int, RouteRequest]]] = {}
        self._turn = 0

    async def _current(self, redis, base_model: str) -> list[ReplicaView]:
        now = self.clock()
        at, views = self._views.get(base_model, (float("-inf"), []))
        if now - at < REFRESH_S:
            return views
        raws = await redis.mget([*health.gen_keys(base_model, len(self.names)).values(), in_service.key(base_model)])
        beacons = read_beacons(raws[:-1])
        serving = self._serving[base_model] = len(in_service.parse(raws[-1]).gen_names(self.names))
        # A replica past the count in service is leaving (a scaler lowered it): no new groups.
        views = [view_of(n, b) if i < serving else dataclasses.replace(view_of(n, b), healthy=False)
                 for i, (n, b) in enumerate(zip(self.names, beacons, strict=True))]
        sent = self._sent.setdefault(base_model, deque())
        while sent and sent[0][0] < now - REMEMBER_S:
            sent.popleft()
        for t, i, req in sent:
            # A group sent after its replica's beacon was taken is not in its figures yet; its
            # adapter, prefix and episode may not be either while it waits there.
            b = beacons[i]
            if b is not None:
                views[i] = routed(views[i], req) if t >= b.get("at", 0.0) else routed(views[i], req, load=False)
        self._views[base_model] = (now, views)
        return views

    async def stream_for(self, redis, base_model: str, item: WorkItem) -> str:
        """The stream of the replica that takes this sample group."""
        views = await self._current(redis, base_model)
        req = route_request(cast(SampleWork, item.body))  # a sample stream's items are sample groups
        i = pick(self.policy, req, views, turn=self._turn, rng=self.rng)
        self._turn += 1
        if i is None:
            i = fallback(req, self._serving.get(base_model, len(self.names)))
        else:
            views[i] = routed(views[i], req)
            self._sent.setdefault(base_model, deque()).append((self.clock(), i, req))
        return queue.sample_stream(base_model, self.names[i])


def reroute_dead_peers(redis, base_model: str, me: str, replicas: int, policy: Policy, *,
                       rng: random.Random | None = None, page: int = 256, db_url: str | None = None) -> int:
    """Move every entry of each dead peer's stream to a live replica (synchronous client); returns
    how many this call moved. Safe to run on every replica at once: each entry moves once. With
    `db_url`, a dead peer that left entries has its Postgres sessions ended first (core.db.end_sessions:
    a frozen one may hold a lock the re-run's settle would wait on)."""
    names, streams = queue.replica_names(replicas), queue.sample_streams(base_model, replicas)
    dead = [i for i, n in enumerate(names) if n != me and not redis.exists(health.consumer_key(streams[i], n))]
    if not dead:
        return 0
    beacons = read_beacons(redis.mget(list(health.gen_keys(base_model, replicas).values())))
    views = [view_of(n, b) for n, b in zip(names, beacons, strict=True)]
    for i in dead:
        views[i] = dataclasses.replace(views[i], healthy=False)
    moved, turn = 0, 0
    for i in dead:
        if db_url and redis.xlen(streams[i]):
            with db.connect(db_url) as conn:
                db.end_sessions(conn, db.session_name("gen", names[i], base_model))
        after = "-"
        while entries := redis.xrange(streams[i], min=after, max="+", count=page):
            for entry_id, fields in entries:
                try:
                    req = route_request(cast(SampleWork, WorkItem.from_fields(fields).body))
                except (MalformedWork, AttributeError):  # moved as it is; its reader drops it
                    req = RouteRequest(n=1)
                j = pick(policy, req, views, turn=turn, rng=rng)
                turn += 1
                j = names.index(me) if j is None else j
                if queue.move(redis, streams[i], queue.SAMPLE_GROUP, entry_id, streams[j]):
                    moved += 1
                    views[j] = routed(views[j], req)
            after = "(" + (entries[-1][0].decode() if isinstance(entries[-1][0], bytes) else entries[-1][0])
        if moved:
            log.warning("moved %d sample groups of %s, which stopped, to live replicas", moved, names[i])
    return moved


class Locality:
    """What a replica served lately, for its beacon: prompt prefixes and episodes, most recent last."""

    def __init__(self, size: int = RECENT):
        self.prefixes, self.sessions = Recent(size), Recent(size)

    def note(self, prompt: Sequence[int], episode: str | None) -> None:
        self.prefixes.touch(prefix_hash(prompt))
        if episode is not None:
            self.sessions.touch(episode)

    def report(self) -> dict:
        return {"prefixes": list(self.prefixes), "sessions": list(self.sessions)}
