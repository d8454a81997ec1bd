"""What "a store cannot be reached right now" looks like (Postgres or Redis restarting, a failover),
and how a worker waits it out.

The API answers these errors with 503 and Retry-After (api.errors). A worker that has work in hand
keeps it and retries until the store is back (`until_reachable`): results, ledger rows and
acknowledgements are written late, never dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import psycopg
import psycopg_pool
import redis

log = logging.getLogger("quilt.stores")

STORE_ERRORS: tuple[type[Exception], ...] = (psycopg.OperationalError, psycopg_pool.PoolTimeout,
                                             redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)

T = TypeVar("T")

FIRST_DELAY_S = 0.2
MAX_DELAY_S = 2.0
REPORT_EVERY_S = 10.0


def until_reachable(fn: Callable[[], T], what: str, *, sleep: Callable[[float], None] = time.sleep) -> T:
    """`fn()`, called again (with a growing pause, up to MAX_DELAY_S) for as long as it fails with a
    store error; any other error propagates. Logs when the wait starts, every REPORT_EVERY_S, and
    when it ends. `fn` must be safe to repeat: publish, settle and ack are."""
    delay, waited, reported = FIRST_DELAY_S, 0.0, None
    while True:
        try:
            value = fn()
        except STORE_ERRORS as exc:
            if reported is None or waited - reported >= REPORT_EVERY_S:
                log.warning("%s: a store is unreachable (%s: %s); waiting %.0f s so far", what,
                            type(exc).__name__, exc, waited)
                reported = waited
            sleep(delay)
            waited += delay
            delay = min(delay * 2, MAX_DELAY_S)
            continue
        if reported is not None:
            log.info("%s: the store is back after %.1f s", what, waited)
        return value
