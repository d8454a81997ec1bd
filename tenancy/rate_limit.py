"""Tokens per minute: one token bucket per tenant in Redis, shared by every API replica.

The bucket holds up to a minute of the tenant's `tokens_per_minute` and refills continuously. A
call's tokens (training: model-input tokens; sampling: prompt tokens plus `max_tokens` for each
sample, what it may consume) are taken when its stream entry is appended, in the same Lua script
(`core.queue.enqueue` with this `Bucket`), so only work that reaches a worker is counted, once
however often the call is retried; a call the bucket cannot hold yet takes nothing and learns how
many seconds until it could: the 429's `Retry-After`. The check and the take run on Redis' own
clock (core.token_bucket), so replicas never race or disagree on the time.
"""

from __future__ import annotations

from core.queue import Bucket
from tenancy.auth import Principal


def bucket_key(tenant_id: str) -> str:
    return f"quilt:tpm:{tenant_id}"


def bucket(who: Principal, tokens: int) -> Bucket | None:
    """What a call of `who` carrying `tokens` takes from its tenant's bucket (None: nothing). The
    caller refuses counts above `tokens_per_minute` first: the bucket never holds more than a
    minute's worth."""
    if tokens <= 0:
        return None
    return Bucket(bucket_key(who.tenant_id), who.tokens_per_minute, tokens)
