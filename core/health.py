"""Liveness beacons: each worker refreshes a Redis key with a TTL; healthz reads them.

A trainer's or generation worker's key is written by a `Heartbeat` thread of its own every
second with a 3 s TTL, so healthz shows a dead worker within 3 s however long its current round
runs; the worker's loop only hands the thread its latest figures. (A live but stuck loop keeps
beating: the figures' `at` stops moving, which the dashboard shows.)
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from core import queue

log = logging.getLogger(__name__)

HEALTH_TTL_S = 3
HEARTBEAT_EVERY_S = 1.0
CELERY_TTL_S = 45
WAITS_KEPT = 256  # recent queue waits a worker summarises in its beacon


def trainer_key(base_model: str, shard: str | None = None) -> str:
    """A trainer's beacon: the base's one, or shard `shard`'s where there are several."""
    return f"quilt:health:trainer:{base_model}" if shard is None else f"quilt:health:trainer:{base_model}@{shard}"


def trainer_keys(base_model: str, shards: int) -> dict[str, str]:
    """Beacon key of each trainer of a base, by the name health reports it under."""
    return _by_worker(base_model, queue.shard_names(shards) if shards > 1 else [], trainer_key)


def model_trainer_key(base_model: str, shard: str | None, shards: int) -> str:
    """The beacon of the trainer holding a model placed on `shard` (None: not placed yet)."""
    return trainer_key(base_model, shard if shards > 1 and shard else None)


def trainer_rounds_key(base_model: str) -> str:
    """Recent fused-round records (newest first), for the dashboard."""
    return f"quilt:stats:trainer:{base_model}:rounds"


def gen_key(base_model: str, replica: str | None = None) -> str:
    """A generation worker's beacon: the base's one, or replica `replica`'s where there are several."""
    return f"quilt:health:gen:{base_model}" if replica is None else f"quilt:health:gen:{base_model}@{replica}"


def gen_keys(base_model: str, replicas: int) -> dict[str, str]:
    """Beacon key of each generation worker of a base, by the name health reports it under."""
    return _by_worker(base_model, queue.replica_names(replicas) if replicas > 1 else [], gen_key)


def _by_worker(base_model: str, names: list[str], key: Callable[..., str]) -> dict[str, str]:
    """The base's one key (no names), or each named worker's, as `<base>@<name>` -> key."""
    if not names:
        return {base_model: key(base_model)}
    return {f"{base_model}@{name}": key(base_model, name) for name in names}


def consumer_key(stream: str, consumer: str) -> str:
    """Set (with a TTL) while the stream consumer `consumer` is alive: its pending entries are its own."""
    return f"quilt:health:consumer:{stream}:{consumer}"

CELERY_KEY = "quilt:health:celery"


def wait_figures(waits: Iterable[float]) -> dict[str, Any]:
    """A worker's recent queue waits (seconds from a request's arrival to its work starting) as its
    beacon carries them: `queue_wait_p50_s`, `queue_wait_p95_s` (None while there are none) and
    how many they summarise. Read by the status page (api.status_board)."""
    ordered = sorted(max(0.0, w) for w in waits)
    if not ordered:
        return {"queue_wait_p50_s": None, "queue_wait_p95_s": None, "queue_wait_n": 0}

    def at(q: float) -> float:  # nearest rank: a wait some request really had, not an interpolation
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)

    return {"queue_wait_p50_s": at(0.5), "queue_wait_p95_s": at(0.95), "queue_wait_n": len(ordered)}


def beacon(redis: Any, key: str, ttl_s: int, **info: Any) -> None:
    redis.set(key, json.dumps({"at": time.time(), **info}), ex=ttl_s)


class Heartbeat:
    """Writes `key` every HEARTBEAT_EVERY_S from a daemon thread, with the figures last given to
    `update` (the figures' own time is `at`; the key's freshness is the process's)."""

    def __init__(self, redis: Any, key: str, *, also: tuple[tuple[str, int], ...] = ()) -> None:
        self.redis = redis  # a synchronous client; redis-py's pool is safe across threads
        self.key = key
        # Other keys this process's life keeps set, with their TTLs (a trainer shard's consumer
        # liveness key: others re-place its models once it lapses, however long a round runs).
        self.also = also
        self._info: dict[str, Any] = {"at": time.time(), "pid": os.getpid()}
        self._stopped = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat {key}", daemon=True)

    def update(self, *, push: bool = False, **info: Any) -> None:
        """The figures the next write carries; `push`: write them at once, not at the next beat
        (a generation replica's load, which the API routes by)."""
        self._info = {"at": time.time(), "pid": os.getpid(), **info}
        if push:
            self._wake.set()

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        """On a clean exit: the key goes at once, so health does not wait for the TTL."""
        self._stopped.set()
        self._wake.set()
        self._thread.join(timeout=2 * HEARTBEAT_EVERY_S)
        try:
            self.redis.delete(self.key)
        except Exception:  # stopping must not fail on a Redis that is already gone
            log.warning("could not remove %s", self.key)

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                pipe = self.redis.pipeline()
                pipe.set(self.key, json.dumps(self._info), ex=HEALTH_TTL_S)
                for key, ttl_s in self.also:
                    pipe.set(key, b"1", ex=ttl_s)
                pipe.execute()
            except Exception as exc:  # Redis down: health is down too; keep trying
                log.warning("heartbeat %s: %s", self.key, exc)
            self._wake.wait(HEARTBEAT_EVERY_S)
            self._wake.clear()
