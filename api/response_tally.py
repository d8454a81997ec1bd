"""How many responses the API answered, and how many were 5xx, over every API process.

The API runs as several processes (uvicorn --workers, pods), so a count kept in one would show the
status page a fraction of the service. Each process counts in memory (`ResponseTally.add`: two
integer additions per response, no I/O on the request's path) and `publish` adds what it counted
to Redis once a second (probes and the status page itself are left out:
api.errors.UNTALLIED), into one hash per BUCKET_S bucket (`quilt:status:responses:<bucket start>`,
fields `n` and `5xx`) that every process shares; `read` fetches the buckets a status page needs.
A process that dies loses at most its last second of counts; while Redis is down the counts wait
in the process (the newest MAX_HELD_BUCKETS buckets of them) and are added once it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from api.status_board import BUCKET_S, WINDOWS_S, ResponseCounts, bucket_of, buckets_for
from core.stores import STORE_ERRORS

log = logging.getLogger("quilt.api")

KEY_PREFIX = "quilt:status:responses:"
PUBLISH_EVERY_S = 1.0
KEPT_S = max(WINDOWS_S) + 2 * BUCKET_S  # a bucket outlives the longest window that reads it
MAX_HELD_BUCKETS = 60  # unpublished buckets kept while Redis is down (ten minutes of counts)


def key(bucket: int) -> str:
    return f"{KEY_PREFIX}{bucket}"


class ResponseTally:
    """This process's counts not yet published, per bucket."""

    def __init__(self, clock=time.time):
        self.clock = clock
        self.pending: dict[int, list[int]] = {}  # bucket -> [responses, 5xx]

    def add(self, status: int) -> None:
        counts = self.pending.get(bucket := bucket_of(self.clock()))
        if counts is None:
            counts = self.pending[bucket] = [0, 0]
        counts[0] += 1
        if status >= 500:
            counts[1] += 1

    def take(self) -> dict[int, list[int]]:
        taken, self.pending = self.pending, {}
        return taken

    def give_back(self, taken: dict[int, list[int]]) -> None:
        """Counts a publish could not write: merged back, the newest MAX_HELD_BUCKETS kept."""
        for bucket, (n, errors) in taken.items():
            counts = self.pending.setdefault(bucket, [0, 0])
            counts[0] += n
            counts[1] += errors
        for bucket in sorted(self.pending)[:-MAX_HELD_BUCKETS]:
            del self.pending[bucket]


async def flush(redis, tally: ResponseTally) -> None:
    """Add this process's pending counts to the shared buckets (one round trip)."""
    taken = tally.take()
    if not taken:
        return
    pipe = redis.pipeline(transaction=False)
    for bucket, (n, errors) in taken.items():
        pipe.hincrby(key(bucket), "n", n)
        if errors:
            pipe.hincrby(key(bucket), "5xx", errors)
        pipe.expire(key(bucket), KEPT_S)
    try:
        await pipe.execute()
    except STORE_ERRORS:
        tally.give_back(taken)
        raise


async def publish(redis, tally: ResponseTally, every_s: float = PUBLISH_EVERY_S) -> None:
    """Flush every `every_s` until cancelled, and once more on the way out (a clean shutdown
    loses nothing)."""
    try:
        while True:
            await asyncio.sleep(every_s)
            try:
                await flush(redis, tally)
            except STORE_ERRORS as exc:
                log.warning("could not publish response counts: %s", exc)
    finally:
        with contextlib.suppress(*STORE_ERRORS):
            await flush(redis, tally)


async def read(redis, now: float, window_s: int = max(WINDOWS_S)) -> dict[int, ResponseCounts]:
    """The shared counts of the buckets the last `window_s` seconds span."""
    buckets = buckets_for(now, window_s)
    pipe = redis.pipeline(transaction=False)
    for bucket in buckets:
        pipe.hmget(key(bucket), "n", "5xx")
    out = {}
    for bucket, (n, errors) in zip(buckets, await pipe.execute(), strict=True):
        if n is not None:
            out[bucket] = ResponseCounts(int(n), int(errors or 0))
    return out
