"""The queue and futures protocol between the API and the workers (Redis).

Work: one stream per base model and worker kind (`quilt:train:{base}`, `quilt:sample:{base}`), read
by a consumer group (`core.consumer`); each entry is a `core.work.WorkItem`. Results: one tiny
stream per future (`quilt:future:{request_id}`) holding a single entry, so a long-poll is
`XREAD BLOCK` from the start: it returns at once if the result is there, otherwise when it
arrives, and any number of pollers (and re-polls) see the same result until the TTL ends.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from core import result_bytes, token_bucket
from core.errors import QuiltError, QuotaExceeded, UserError
from core.settings import get_tenancy_settings
from core.work import WorkItem, WorkKind

TRAIN_GROUP = "trainers"
# Sampling: one stream per base model, consumer group `samplers` (every generation worker of that
# base reads it). Cancellation is broadcast, because the group hands an entry to one worker only:
# a key that says "cancelled" (read when the work arrives) plus a pub/sub message to every worker.
SAMPLE_GROUP = "samplers"
CANCEL_CHANNEL = "quilt:cancels"


def train_stream(base_model: str, shard: str | None = None) -> str:
    """The base's one training stream, or with several trainer shards (QUILT_TRAINER_SHARDS) shard
    `shard`'s own, which the API sends the calls of the models placed there to (scaleout.placement)."""
    return f"quilt:train:{base_model}" if shard is None else f"quilt:train:{base_model}@{shard}"


def shard_names(count: int) -> list[str]:
    """The trainer shards of a base model (QUILT_TRAINER_SHARDS), as their workers are named."""
    return [f"shard-{i}" for i in range(count)]


def shard_of(consumer_name: str, count: int) -> str:
    """The shard a trainer worker is, from its consumer name (`shard-<i>`, or a StatefulSet's pod
    `quilt-trainer-<i>`); ValueError unless 0 <= i < count."""
    return _ordinal(consumer_name, count, "shard", "QUILT_TRAINER_SHARDS")


def sample_stream(base_model: str, replica: str | None = None) -> str:
    """The base's one sampling stream, or with several generation replicas (QUILT_GEN_REPLICAS)
    replica `replica`'s own, which the API routes groups into (gen_pool.router)."""
    return f"quilt:sample:{base_model}" if replica is None else f"quilt:sample:{base_model}@{replica}"


def replica_names(count: int) -> list[str]:
    """The generation replicas of a base model (QUILT_GEN_REPLICAS), as their workers are named."""
    return [f"gen-{i}" for i in range(count)]


def replica_of(consumer_name: str, count: int) -> str:
    """The replica a generation worker is, from its consumer name: `gen-<i>` itself, or any name
    ending in `-<i>` (a StatefulSet's pod `quilt-gen-<i>`); ValueError unless 0 <= i < count."""
    return _ordinal(consumer_name, count, "gen", "QUILT_GEN_REPLICAS")


def _ordinal(consumer_name: str, count: int, prefix: str, setting: str) -> str:
    head, _, ordinal = consumer_name.rpartition("-")
    if not head or not ordinal.isdigit() or int(ordinal) >= count:
        raise ValueError(f"worker {consumer_name!r} is not one of the {count} that {setting} names: its name "
                         f"must end in -0 ... -{count - 1}")
    return f"{prefix}-{int(ordinal)}"


def train_streams(base_model: str, shards: int) -> list[str]:
    """Every stream that holds the base's training work (the one, or each shard's)."""
    return [train_stream(base_model, name) for name in (shard_names(shards) if shards > 1 else [None])]


def sample_streams(base_model: str, replicas: int) -> list[str]:
    """Every stream that holds the base's sampling work (the one, or each replica's)."""
    return [sample_stream(base_model, name) for name in (replica_names(replicas) if replicas > 1 else [None])]


def stream_for(item: WorkItem, base_model: str) -> str:
    """Sampling goes to the generation pool's stream, everything else to the trainer's."""
    return sample_stream(base_model) if item.kind is WorkKind.SAMPLE else train_stream(base_model)


def cancel_key(request_id: str) -> str:
    return f"quilt:cancel:{request_id}"


def delta_key(request_id: str) -> str:
    """A streamed sampling request's tokens as they are sampled: entries {"i": sequence index,
    "o": the position of the first, "t": JSON token ids}, in order; the future (future_key) still
    holds the whole result. A sequence run again (its worker died) starts again at "o": 0."""
    return f"quilt:deltas:{request_id}"


async def request_cancel(redis: Any, request_id: str, ttl_s: int) -> None:
    """Ask the generation pool to abort a sampling request (cancel_future; an OpenAI caller who
    left): its future fails with a `cancelled` user error and its tokens stop being spent."""
    await redis.set(cancel_key(request_id), b"1", ex=ttl_s)
    await redis.publish(CANCEL_CHANNEL, request_id)


def future_key(request_id: str) -> str:
    return f"quilt:future:{request_id}"


def _text(fields: dict[Any, Any], name: str) -> str | None:
    """A stream entry's field as text, whichever way the client decoded it."""
    value = fields.get(name.encode(), fields.get(name))
    return value.decode() if isinstance(value, bytes) else value


def _required(fields: dict[Any, Any], name: str) -> str:
    """`_text` of a field every such entry has (KeyError if it is missing)."""
    value = _text(fields, name)
    if value is None:
        raise KeyError(name)
    return value


@dataclass(frozen=True)
class Outcome:
    """A finished future: either `result` or `error` (the typed error's JSON). Once stored it also
    names its tenant and kind (`publish`), so the API can answer a finished future from Redis
    alone (api.routes.futures); None for one stored before they were. One read back from Redis
    also keeps the JSON text it was stored as (`body`), which a JSON answer sends as it is: turning
    a large result back into JSON took the API's event loop tens of milliseconds."""

    request_id: str
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    tenant_id: str | None = None
    kind: str | None = None
    body: str | None = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.error is None

    def encode(self) -> dict[str, str]:
        if self.body is not None:  # encoded once already (`storable`): a large result is not dumped twice
            return {"status": "done" if self.error is None else "failed", "body": self.body}
        if self.error is not None:
            return {"status": "failed", "body": json.dumps(self.error)}
        # allow_nan=False: a NaN would be stored, then refused by every JSON encoder that reads it.
        return {"status": "done", "body": json.dumps(self.result, separators=(",", ":"), allow_nan=False)}

    @classmethod
    def decode(cls, request_id: str, fields: dict[Any, Any]) -> Outcome:
        body = _required(fields, "body")
        stored: dict[str, Any] = {"tenant_id": _text(fields, "tenant"), "kind": _text(fields, "kind"), "body": body}
        if _text(fields, "status") == "failed":
            return cls(request_id, error=json.loads(body), **stored)
        return cls(request_id, result=json.loads(body), **stored)


def failure(request_id: str, err: QuiltError) -> Outcome:
    err.request_id = err.request_id or request_id
    return Outcome(request_id, error=err.to_json())


NOT_ENCODABLE = ("the result holds a number JSON cannot carry (NaN or Infinity): a loss or logprob overflowed; "
                 "make the request's weights or advantages smaller")


# The tinker SDK numbers the sampling requests of a session's clone `c` from c * CLONE_SPAN; a
# session's completions are kept per clone, as its `retrieve_futures` poller asks for them.
CLONE_SPAN = 1_000_000_000
MAX_CLONE = (2**63 - 1) // CLONE_SPAN - 1  # the largest clone whose seq_ids all fit int64
SESSION_DONE_KEEP = 10_000  # a session's newest completions kept for its poller (approximately)
_SEQ_SPAN = 1_000_000  # entries one stream gets in one millisecond, at most (a stream id's second part)


def session_done_key(sampling_session_id: str, clone: int) -> str:
    return f"quilt:sdone:{sampling_session_id}:{clone}"


def cursor_of(entry_id: str | bytes) -> int:
    """A stream entry id (`<ms>-<seq>`) as the integer cursor tinker's `retrieve_futures` carries."""
    ms, seq = (entry_id.decode() if isinstance(entry_id, bytes) else entry_id).split("-")
    return int(ms) * _SEQ_SPAN + int(seq)


def appended_at(entry_id: str | bytes) -> float:
    """When Redis appended a stream entry, in Unix seconds: its id's first part is Redis's clock in ms."""
    ms = (entry_id.decode() if isinstance(entry_id, bytes) else entry_id).partition("-")[0]
    return int(ms) / 1000


def entry_of(cursor: int) -> str:
    ms, seq = divmod(cursor, _SEQ_SPAN)
    return f"{ms}-{seq}"


def storable(outcome: Outcome) -> Outcome:
    """The outcome as `publish` stores it, its JSON text kept in `body`: a result that cannot be
    encoded becomes a failure of category `user` naming the cause. A worker settles this form
    before publishing it, so the request row and the future say the same thing."""
    if outcome.body is not None:
        return outcome
    try:
        fields = outcome.encode()
    except ValueError:
        outcome = failure(outcome.request_id, UserError(NOT_ENCODABLE, field="result"))
        fields = outcome.encode()
    return replace(outcome, body=fields["body"])


def publish(redis: Any, outcome: Outcome, ttl_s: int, item: WorkItem) -> Outcome:
    """Store the finished future of `item` (workers; the synchronous client). Returns what was
    stored (`storable`). A sampling request of a session is also recorded as done in its session's
    completion stream (what `retrieve_futures` reads).

    Call it only once the request's row is finished (`billing.ledger.settle`, or
    `core.records.mark_finished` committed): a client that reads the future may retry at once, and
    the quota counts rows that are not finished."""
    outcome = storable(outcome)
    fields = outcome.encode()
    key = future_key(outcome.request_id)
    pipe = redis.pipeline()
    pipe.xadd(key, {**fields, "tenant": item.tenant_id, "kind": str(item.kind)})
    pipe.expire(key, ttl_s)
    result_bytes.note(pipe, item.tenant_id, len(fields["body"]), ttl_s, get_tenancy_settings().max_result_bytes)
    if item.kind is WorkKind.SAMPLE and item.model_id:
        note_session_done(pipe, item.model_id, item.seq_id, outcome.request_id, ttl_s,
                          size=None if fields["status"] == "failed" else len(fields["body"]))
    pipe.execute()
    return outcome


async def publish_answer(redis: Any, outcome: Outcome, ttl_s: int, tenant_id: str, kind: str) -> None:
    """Store a future the API answers itself, at once (no worker, no request row: a create_custom_loss).
    It names its tenant, so `retrieve_future` answers it to that tenant only."""
    fields = storable(outcome).encode()
    key = future_key(outcome.request_id)
    pipe = redis.pipeline()
    pipe.xadd(key, {**fields, "tenant": tenant_id, "kind": kind})
    pipe.expire(key, ttl_s)
    await pipe.execute()


def unanswered(redis: Any, request_ids: list[str]) -> set[str]:
    """Of these finished requests, those whose future was never stored though their client may
    still ask for it: their worker died between settling and publishing (synchronous client). A
    request's append marker (`enqueued_key`) lives no longer than its future could, so a request
    whose marker is gone is past its future's lifetime, or was read for good, not unanswered."""
    if not request_ids:
        return set()
    pipe = redis.pipeline(transaction=False)
    for request_id in request_ids:
        pipe.exists(future_key(request_id))
        pipe.get(enqueued_key(request_id))
    replies = pipe.execute()
    return {r for r, stored, marker in zip(request_ids, replies[::2], replies[1::2], strict=True)
            if not stored and was_appended(marker)}


def note_session_done(redis: Any, sampling_session_id: str, seq_id: int, request_id: str, ttl_s: int, *,
                      size: int | None) -> None:
    """Record a sampling request of a session as finished (`size`: its result's length) or failed
    (None) in its clone's completion stream."""
    done = session_done_key(sampling_session_id, seq_id // CLONE_SPAN)
    fields = {"request": request_id, "state": "failed"} if size is None else \
        {"request": request_id, "state": "finished", "size": size}
    redis.xadd(done, fields, maxlen=SESSION_DONE_KEEP, approximate=True)
    redis.expire(done, ttl_s)


async def session_completions(redis: Any, sampling_session_id: str, clone: int, cursor: int, timeout_s: float,
                              count: int = 1000) -> tuple[list[dict[str, Any]], int]:
    """The completions of a session's clone after `cursor`, waiting up to `timeout_s` for one (0:
    no wait), and the cursor to pass next. Entries at or before `cursor` have been seen: they are
    trimmed."""
    key = session_done_key(sampling_session_id, clone)
    if cursor:
        await redis.xtrim(key, minid=entry_of(cursor + 1))
    block = max(1, int(timeout_s * 1000)) if timeout_s > 0 else None
    reply = await redis.xread({key: entry_of(cursor)}, count=count, block=block)
    completions = []
    for entry_id, fields in (reply[0][1] if reply else []):
        done: dict[str, Any] = {"state": _text(fields, "state"), "request_id": _text(fields, "request")}
        if done["state"] == "finished":
            done["response_payload_uncompressed_size"] = int(_required(fields, "size"))
        completions.append(done)
        cursor = cursor_of(entry_id)
    return completions, cursor


# Of the futures in the first half of KEYS, those that hold a sampling result of tenant ARGV[1] are
# deleted with their append markers (the second half, in the same order); others are left. Without
# its marker a finished request reads as expired (410), not as an answer still on its way.
_FORGET_SAMPLES = """
local n, half = 0, #KEYS / 2
for i = 1, half do
  local key = KEYS[i]
  local entry = redis.call('XRANGE', key, '-', '+', 'COUNT', 1)[1]
  if entry then
    local tenant, kind
    for i = 1, #entry[2], 2 do
      local name, value = entry[2][i], entry[2][i + 1]
      if name == 'tenant' then tenant = value elseif name == 'kind' then kind = value end
    end
    if tenant == ARGV[1] and kind == 'sample' then
      redis.call('DEL', key, KEYS[half + i])
      n = n + 1
    end
  end
end
return n
"""
_FORGET_CHUNK = 500  # futures per script call, which holds Redis while it runs


async def forget_samples(redis: Any, tenant_id: str, request_ids: list[str]) -> int:
    """Delete the stored results of these sampling requests of the tenant, which its client has
    read for good (tinker's `retrieved_request_ids`), instead of keeping them for the futures'
    lifetime; returns how many were deleted. Another tenant's, and results of other kinds, stay."""
    deleted = 0
    for i in range(0, len(request_ids), _FORGET_CHUNK):
        chunk = request_ids[i:i + _FORGET_CHUNK]
        keys = [future_key(r) for r in chunk] + [enqueued_key(r) for r in chunk]
        deleted += await redis.eval(_FORGET_SAMPLES, len(keys), *keys, tenant_id)
    return deleted


async def ready(redis: Any, request_id: str) -> Outcome | None:
    """The future's outcome if it is stored already; never waits."""
    entries = await redis.xrange(future_key(request_id), count=1)
    return Outcome.decode(request_id, entries[0][1]) if entries else None


async def wait(redis: Any, request_id: str, timeout_s: float) -> Outcome | None:
    """Long-poll one future; None when it is still pending after `timeout_s`."""
    reply = await redis.xread({future_key(request_id): "0-0"}, count=1, block=max(1, int(timeout_s * 1000)))
    if not reply:
        return None
    _stream, entries = reply[0]
    _entry_id, fields = entries[0]
    return Outcome.decode(request_id, fields)


def enqueued_key(request_id: str) -> str:
    return f"quilt:enqueued:{request_id}"


@dataclass(frozen=True)
class Bucket:
    """Tokens an append takes from a token bucket (core.token_bucket) in the same step."""

    key: str
    per_minute: int
    cost: int


# The marker and the entry in one step: a request's entry is appended at most once, however many
# times admission runs for it (a client's retry after the API died between commit and append). With
# a bucket (KEYS[3]) the request's tokens are taken in that step too; when they do not fit, the
# marker records the refusal ('r' and the wait), so no later run appends the request either.
# KEYS[3] is the tenant's result-bytes flag (core.result_bytes): while it is set nothing new is
# appended, and nothing is marked, so a retry once it clears is appended. With ARGV[4] = '0' a
# refusal is not marked: the request waits in a queue state (api.queue_states) and is tried again.
# Returns {1} appended now, {0} appended before, {2, seconds to wait} refused, {3, bytes} over.
_ENQUEUE_ONCE = token_bucket.LUA + """
local mark = redis.call('GET', KEYS[1])
if mark == '1' then return {0} end
if mark then return {2, string.sub(mark, 2)} end
local over = redis.call('GET', KEYS[3])
if over then return {3, over} end
if #KEYS == 4 then
  local admitted, value = take_tokens(KEYS[4], tonumber(ARGV[2]), tonumber(ARGV[3]))
  if admitted == 0 then
    if ARGV[4] == '1' then redis.call('SET', KEYS[1], 'r' .. tostring(value), 'EX', ARGV[1]) end
    return {2, tostring(value)}
  end
end
redis.call('SET', KEYS[1], '1', 'EX', ARGV[1])
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 5))
return {1}
"""


async def enqueue(redis: Any, base_model: str, item: WorkItem, ttl_s: int, stream: str | None = None,
                  bucket: Bucket | None = None, *, mark_refusal: bool = True) -> float | None:
    """Append `item` to its worker's stream (or to `stream`) unless an entry for its request id
    was already appended in the last `ttl_s` seconds (the future's lifetime), taking `bucket`'s
    tokens as it does. None: the entry is in the stream (appended now or before); else the
    seconds until the bucket holds the tokens, and the request is never appended (its marker says
    so for `ttl_s`; without `mark_refusal` nothing is marked, so a later try may append it).
    ResultBytesFull when the tenant's stored results are past their bound."""
    keys = [enqueued_key(item.request_id), stream or stream_for(item, base_model),
            result_bytes.over_key(item.tenant_id)]
    take = ["0", "0"]
    if bucket is not None:
        keys.append(bucket.key)
        take = [str(bucket.per_minute), str(bucket.cost)]
    args = [str(ttl_s), *take, "1" if mark_refusal else "0"] + [part for pair in item.to_fields().items() for part in pair]
    reply = await redis.eval(_ENQUEUE_ONCE, len(keys), *keys, *args)
    if int(reply[0]) == 3:
        raise ResultBytesFull(int(reply[1]))
    return float(reply[1]) if int(reply[0]) == 2 else None


class ResultBytesFull(QuotaExceeded):
    """The tenant's stored results and token streams take more of Redis than it may hold."""

    def __init__(self, stored: int):
        super().__init__(f"your stored results and token streams take {stored:,} bytes of Redis, past your limit "
                         f"of {get_tenancy_settings().max_result_bytes:,}; they expire with their futures "
                         "(retrieve what you need); new work is refused until then", field="result_bytes",
                         retry_after_s=result_bytes.OVER_FLAG_S)


def was_appended(marker: bytes | None) -> bool:
    """Whether an append marker (`enqueued_key`'s value) says the request's entry was appended
    (not absent, not a refusal)."""
    return marker in (b"1", "1")


MOVED_FIELD = "moved"  # how often an entry was moved off a dead replica's stream (counts as a delivery)

# Move one entry to another stream, at most once however many workers try: whoever deletes it
# from the source appends it to the destination, with its move count raised.
_MOVE = """
local found = redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1])
if #found == 0 then return false end
redis.call('XACK', KEYS[1], ARGV[2], ARGV[1])
redis.call('XDEL', KEYS[1], ARGV[1])
local fields, out, moved = found[1][2], {}, 0
for i = 1, #fields, 2 do
  if fields[i] == ARGV[3] then moved = tonumber(fields[i + 1]) or 0
  else out[#out + 1] = fields[i]; out[#out + 1] = fields[i + 1] end
end
out[#out + 1] = ARGV[3]
out[#out + 1] = tostring(moved + 1)
return redis.call('XADD', KEYS[2], '*', unpack(out))
"""


def move(redis: Any, source: str, group: str, entry_id: str, destination: str) -> bool:
    """Move a stream entry (pending or not) from `source` to `destination` (synchronous client);
    True if this call moved it."""
    return redis.eval(_MOVE, 2, source, destination, entry_id, group, MOVED_FIELD) is not None
