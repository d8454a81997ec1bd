"""A call's stream entry and its tokens per minute in one Lua script (core.queue.enqueue with a
bucket), against the stack's real Redis: appended once, tokens taken once, and a refusal that no
later run of the script can turn into an append."""

from __future__ import annotations

import asyncio
import os

import pytest

from core import queue
from core.work import Rejected, WorkItem, WorkKind

pytestmark = pytest.mark.stack


def _item(name: str) -> WorkItem:
    return WorkItem(f"req-take-{name}-{os.urandom(4).hex()}", "ten-take", "m", 1, WorkKind.REJECTED, 0,
                    Rejected("test"))


def test_an_append_takes_its_tokens_once_and_a_refused_one_is_never_appended(stack):
    from redis.asyncio import Redis

    suffix = os.urandom(4).hex()
    stream, bucket = f"test:take:stream:{suffix}", f"test:take:bucket:{suffix}"

    async def scenario() -> None:
        r = Redis.from_url(stack.redis_url)
        try:
            take = queue.Bucket(bucket, 100, 60)
            first, second = _item("first"), _item("second")
            assert await queue.enqueue(r, "b", first, 60, stream, take) is None  # appended, 60 taken
            assert await queue.enqueue(r, "b", first, 60, stream, take) is None  # a retry: nothing taken
            left = float(await r.hget(bucket, "tokens"))
            assert 40 <= left < 41
            wait_s = await queue.enqueue(r, "b", second, 60, stream, take)  # 60 do not fit in about 40
            assert wait_s is not None and 11 < wait_s <= 12
            assert float(await r.hget(bucket, "tokens")) == left  # a refusal takes nothing
            await r.hset(bucket, mapping={"tokens": "100"})  # the bucket refills; the refusal stands
            assert await queue.enqueue(r, "b", second, 60, stream, take) is not None
            assert queue.was_appended(await r.get(queue.enqueued_key(first.request_id)))
            assert not queue.was_appended(await r.get(queue.enqueued_key(second.request_id)))
            entries = await r.xrange(stream)
            assert [WorkItem.from_fields(fields).request_id for _id, fields in entries] == [first.request_id]
            assert await queue.enqueue(r, "b", _item("free"), 60, stream) is None  # no bucket: no take
            assert float(await r.hget(bucket, "tokens")) == 100
        finally:
            await r.delete(stream, bucket)
            await r.aclose()

    asyncio.run(scenario())
