"""Redis clients. URLs may be redis://, rediss:// or unix:// (the embedded server)."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis

from core import embedded, waits
from core.settings import CoreSettings, get_core_settings


def resolve_url(settings: CoreSettings | None = None) -> str:
    return embedded.redis_url(settings or get_core_settings())


def sync_client(url: str | None = None) -> redis.Redis:
    return redis.Redis.from_url(url or resolve_url(), decode_responses=False)


# retrieve_future long-polls with XREAD BLOCK for up to 40 s (ApiSettings.long_poll_seconds); redis-py 8
# defaults socket_timeout to 5 s, which turned every poll longer than that into a 500.
ASYNC_SOCKET_TIMEOUT_S = 60.0


def async_client(url: str) -> aioredis.Redis:
    """An asyncio client; its commands count in the current request's waits (core.waits)."""
    return waits.TimedRedis.from_url(url, decode_responses=False, max_connections=256,
                                     socket_timeout=ASYNC_SOCKET_TIMEOUT_S)
