"""The queue and futures protocol between the API and the workers (Redis).

Work: one stream per base model (`quilt:train:{base}`), consumer group `trainers`; each entry is a
`WorkItem`. Results: one tiny stream per future (`quilt:future:{request_id}`) holding a single entry,
so a long-poll is `XREAD BLOCK` from the start: it returns at once if the result is there, otherwise
when it arrives, and any number of pollers (and re-polls) see the same result until the TTL ends.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Literal

from core.errors import QuiltError

TRAIN_GROUP = "trainers"

WorkKind = Literal["create_model", "forward_backward", "forward", "optim_step", "save_weights", "load_weights"]


def train_stream(base_model: str) -> str:
    return f"quilt:train:{base_model}"


# Sampling: one stream per base model, consumer group `samplers` (every generation worker of that
# base reads it). Cancellation is broadcast, because the group hands an entry to one worker only:
# a key that says "cancelled" (read when the work arrives) plus a pub/sub message to every worker.
SAMPLE_GROUP = "samplers"
# A training call the API refused for good, holding its seq_id so later calls do not wait (api.seq_gaps).
REJECTED_KIND = "rejected"
CANCEL_CHANNEL = "quilt:cancels"


def sample_stream(base_model: str) -> str:
    return f"quilt:sample:{base_model}"


def cancel_key(request_id: str) -> str:
    return f"quilt:cancel:{request_id}"


def future_key(request_id: str) -> str:
    return f"quilt:future:{request_id}"


@dataclass(frozen=True)
class WorkItem:
    """One request for a worker. `body` is the validated, normalised request."""

    request_id: str
    tenant_id: str
    model_id: str
    seq_id: int
    kind: str
    n_tokens: int
    body: dict[str, Any]

    def to_fields(self) -> dict[str, str]:
        return {"item": json.dumps(asdict(self), separators=(",", ":"))}

    @classmethod
    def from_fields(cls, fields: dict) -> "WorkItem":
        raw = fields.get(b"item") or fields.get("item")
        return cls(**json.loads(raw))


@dataclass(frozen=True)
class Outcome:
    """A finished future: either `result` or `error` (the typed error's JSON)."""

    request_id: str
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def encode(self) -> dict[str, str]:
        if self.error is not None:
            return {"status": "failed", "body": json.dumps(self.error)}
        return {"status": "done", "body": json.dumps(self.result, separators=(",", ":"))}

    @classmethod
    def decode(cls, request_id: str, fields: dict) -> "Outcome":
        status = (fields.get(b"status") or fields.get("status"))
        body = json.loads(fields.get(b"body") or fields.get("body"))
        if status in (b"failed", "failed"):
            return cls(request_id, error=body)
        return cls(request_id, result=body)


def failure(request_id: str, err: QuiltError) -> Outcome:
    err.request_id = err.request_id or request_id
    return Outcome(request_id, error=err.to_json())


def publish_sync(redis, outcome: Outcome, ttl_s: int) -> None:
    key = future_key(outcome.request_id)
    pipe = redis.pipeline()
    pipe.xadd(key, outcome.encode())
    pipe.expire(key, ttl_s)
    pipe.execute()


async def publish(redis, outcome: Outcome, ttl_s: int) -> None:
    key = future_key(outcome.request_id)
    pipe = redis.pipeline()
    pipe.xadd(key, outcome.encode())
    pipe.expire(key, ttl_s)
    await pipe.execute()


async def wait(redis, request_id: str, timeout_s: float) -> Outcome | None:
    """Long-poll one future; None when it is still pending after `timeout_s`."""
    reply = await redis.xread({future_key(request_id): "0-0"}, count=1, block=max(1, int(timeout_s * 1000)))
    if not reply:
        return None
    _stream, entries = reply[0]
    _entry_id, fields = entries[0]
    return Outcome.decode(request_id, fields)


async def enqueue(redis, base_model: str, item: WorkItem) -> None:
    await redis.xadd(train_stream(base_model), item.to_fields())


def orphaned_consumers(pending: dict[str, int], alive: set[str], me: str) -> list[str]:
    """Consumers whose pending entries another worker should take over: they hold some, and have
    no liveness key (they died and did not come back under the same name)."""
    return sorted(c for c, n in pending.items() if n > 0 and c != me and c not in alive)


async def enqueue_sample(redis, base_model: str, item: WorkItem) -> None:
    await redis.xadd(sample_stream(base_model), item.to_fields())
