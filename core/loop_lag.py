"""How late an API process's event loop runs: the queue every call waits in before its next step.

A call's time in the API (`Server-Timing: app`) is its own CPU, its waits on the stores
(core.waits), and the time it was ready but the loop was running other calls' steps. That last
part hides inside the waits: a store's answer that arrives while the loop is busy sits unread until
the loop gets to it, and counts as `pg` or `redis`. So `watch` measures the loop itself: every
`QUILT_LOOP_LAG_PROBE_S` (10 ms, as Node's event-loop delay monitor defaults to) it asks to be
woken and records how late the wake-up came (`LagHistogram`, cumulative since the process
started). The API publishes it as a beacon per process (`publish`, every BEACON_EVERY_S);
`/metrics` exposes it as `quilt_api_event_loop_lag_seconds` and bench/api_load.py reads the
difference over each phase. A late loop with prompt stores says the process is short of CPU for
its load (more processes, or less work per call); a prompt loop with slow waits says the store is.

uvloop's timers tick in whole milliseconds, so a lateness under 1 ms is mostly rounding. Each
wake-up of an otherwise idle process cost about 200 µs of CPU on this VM (2% of a core at 100 a
second: a timer wake-up in a VM is dear); a busy loop is awake anyway.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

# Upper bounds, seconds. The last bucket (past 1 s) is +Inf.
BOUNDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
BEACON_EVERY_S = 1.0
BEACON_TTL_S = 10
INDEX_KEY = "quilt:health:api"  # set of instances that published a beacon; readers drop stale ones
PRUNE_EVERY = 60  # beats between a publisher's own pruning of the index


def beacon_key(instance: str) -> str:
    return f"{INDEX_KEY}:{instance}"


@dataclass
class LagHistogram:
    """Counts of lateness per bucket of BOUNDS (plus one past the last), and their sum in seconds."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(BOUNDS) + 1))
    sum_s: float = 0.0

    def observe(self, late_s: float) -> None:
        self.counts[bisect.bisect_left(BOUNDS, late_s)] += 1
        self.sum_s += late_s

    @property
    def count(self) -> int:
        return sum(self.counts)

    def minus(self, earlier: LagHistogram) -> LagHistogram:
        """What was observed since `earlier` (a copy of this histogram taken before)."""
        return LagHistogram([a - b for a, b in zip(self.counts, earlier.counts)], self.sum_s - earlier.sum_s)

    def plus(self, other: LagHistogram) -> LagHistogram:
        return LagHistogram([a + b for a, b in zip(self.counts, other.counts)], self.sum_s + other.sum_s)

    def quantile(self, q: float) -> float:
        """The q-quantile in seconds, interpolated linearly inside its bucket (as Prometheus'
        histogram_quantile does); past the last bound, that bound. NaN when empty."""
        n = self.count
        if n == 0:
            return float("nan")
        rank, below = q * n, 0
        for i, c in enumerate(self.counts):
            if c and below + c >= rank:
                if i == len(BOUNDS):
                    return BOUNDS[-1]
                lo = BOUNDS[i - 1] if i else 0.0
                return lo + (BOUNDS[i] - lo) * (rank - below) / c
            below += c
        return BOUNDS[-1]

    def to_json(self) -> dict[str, Any]:
        return {"counts": self.counts, "sum_s": self.sum_s}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> LagHistogram:
        counts = [int(c) for c in raw["counts"]]
        if len(counts) != len(BOUNDS) + 1:
            raise ValueError(f"a loop-lag histogram has {len(BOUNDS) + 1} buckets, this one {len(counts)}")
        return cls(counts, float(raw["sum_s"]))


async def watch(hist: LagHistogram, every_s: float) -> None:
    """Record into `hist`, until cancelled, how late each wake-up after `every_s` comes."""
    while True:
        due = time.perf_counter() + every_s
        await asyncio.sleep(every_s)
        hist.observe(max(0.0, time.perf_counter() - due))


def instance_name() -> str:
    """This process among the API's: host and pid (uvicorn's --workers are processes of one host)."""
    return f"{socket.gethostname()}:{os.getpid()}"


async def publish(redis: Any, hist: LagHistogram, instance: str, every_s: float = BEACON_EVERY_S) -> None:
    """Write `hist` as this process's beacon every `every_s` until cancelled. The index lives as
    long as some process beats, and every PRUNE_EVERY beats each process drops the instances whose
    beacon lapsed, so processes that come and go leave nothing behind. A store outage only skips
    beats: the beacon is a measurement, not a liveness signal anyone acts on."""
    key, beats = beacon_key(instance), 0
    while True:
        try:
            async with redis.pipeline(transaction=False) as pipe:
                pipe.set(key, json.dumps({"at": time.time(), "instance": instance, "lag": hist.to_json()}),
                         ex=BEACON_TTL_S)
                pipe.sadd(INDEX_KEY, instance)
                pipe.expire(INDEX_KEY, BEACON_TTL_S)
                await pipe.execute()
            if beats % PRUNE_EVERY == 0:
                await read_all(redis)
        except RedisError:  # Redis down, restarting or refusing: the next beat tries again
            pass
        beats += 1
        await asyncio.sleep(every_s)


def instances(members: set[bytes]) -> list[str]:
    """The index's members as instance names, in the order `decode` and a reader's MGET of their
    `beacon_key`s use."""
    return sorted(m.decode() for m in members)


def decode(names: list[str], raws: list[Any]) -> tuple[dict[str, LagHistogram], list[str]]:
    """The histograms of the instances `names` from their beacons `raws` (as MGET returns them, in
    that order), and the instances whose beacon lapsed. A beacon of another shape (a process of
    another version during an upgrade, with other bounds) is left out."""
    out, gone = {}, []
    for instance, raw in zip(names, raws):
        if raw is None:
            gone.append(instance)
            continue
        try:
            out[instance] = LagHistogram.from_json(json.loads(raw)["lag"])
        except (ValueError, KeyError, TypeError):
            continue
    return out, gone


async def read_all(redis: Any) -> dict[str, LagHistogram]:
    """Every live API process's histogram, by instance; instances whose beacon lapsed leave the index."""
    names = instances(await redis.smembers(INDEX_KEY))
    if not names:
        return {}
    out, gone = decode(names, await redis.mget([beacon_key(n) for n in names]))
    if gone:
        await redis.srem(INDEX_KEY, *gone)
    return out
