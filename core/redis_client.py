"""Redis clients. URLs may be redis://, rediss:// or unix:// (the embedded server)."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis

from core import embedded
from core.settings import CoreSettings, get_core_settings


def resolve_url(settings: CoreSettings | None = None) -> str:
    return embedded.redis_url(settings or get_core_settings())


def sync_client(url: str | None = None) -> redis.Redis:
    return redis.Redis.from_url(url or resolve_url(), decode_responses=False)


def async_client(url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(url, decode_responses=False, max_connections=256)
