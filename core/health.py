"""Liveness beacons: each worker refreshes a Redis key with a TTL; healthz reads them."""

from __future__ import annotations

import json
import time

TRAINER_TTL_S = 15
CELERY_TTL_S = 45


def trainer_key(base_model: str) -> str:
    return f"quilt:health:trainer:{base_model}"


def trainer_rounds_key(base_model: str) -> str:
    """Recent fused-round records (newest first), for the dashboard."""
    return f"quilt:stats:trainer:{base_model}:rounds"


def gen_key(base_model: str) -> str:
    return f"quilt:health:gen:{base_model}"


GEN_TTL_S = 15


def consumer_key(stream: str, consumer: str) -> str:
    """Set (with a TTL) while the stream consumer `consumer` is alive: its pending entries are its own."""
    return f"quilt:health:consumer:{stream}:{consumer}"

CELERY_KEY = "quilt:health:celery"


def beacon(redis, key: str, ttl_s: int, **info) -> None:
    redis.set(key, json.dumps({"at": time.time(), **info}), ex=ttl_s)


async def beacon_async(redis, key: str, ttl_s: int, **info) -> None:
    await redis.set(key, json.dumps({"at": time.time(), **info}), ex=ttl_s)
