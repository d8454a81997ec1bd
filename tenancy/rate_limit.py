"""Tokens per minute: one token bucket per tenant in Redis, shared by every API replica.

The bucket holds up to a minute of the tenant's `tokens_per_minute` and refills continuously. A
call's tokens (training: model-input tokens; sampling: prompt tokens plus `max_tokens` for each
sample, what it may consume) are taken when its stream entry is appended, in the same Lua script
(`core.queue.enqueue` with this `Bucket`), so only work that reaches a worker is counted, once
however often the call is retried; a call the bucket cannot hold yet takes nothing and learns how
many seconds until it could: the 429's `Retry-After`. The check and the take run on Redis' own
clock (core.token_bucket), so replicas never race or disagree on the time.

Since a call's row is written before its append, a call the bucket refuses costs Postgres an
insert and a delete. So each API process remembers the last refusal it saw per tenant
(`Shortfalls`): the bucket's level then, from which it can only have refilled at the tenant's
rate (other processes' takes only lower it), bounds it from above now, and a call that cannot fit
even that bound is refused without a row (`certain_wait`). A client that ignores `Retry-After`
thus costs one read per call, as before the take moved into the append.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Shortfall:
    """What one refusal said of a tenant's bucket: its rate, and its level at `at` (monotonic)."""

    per_minute: int
    level: float
    at: float


def certain_wait(shortfall: Shortfall | None, per_minute: int, cost: int, now: float) -> float | None:
    """Seconds a take of `cost` must wait at least, given the last refusal seen (the bucket has at
    most refilled since, up to a full minute's worth), or None when the take may fit. A rate changed
    since (`quilt tenants set-quota`) voids what the refusal said."""
    if shortfall is None or shortfall.per_minute != per_minute:
        return None
    level = min(per_minute, shortfall.level + max(0.0, now - shortfall.at) * per_minute / 60)
    return (cost - level) * 60 / per_minute if cost > level else None


_MAX_TENANTS = 100_000  # past it the memory starts over rather than grow without bound


class Shortfalls:
    """This process's last refusal per tenant (see the module docstring)."""

    def __init__(self) -> None:
        self._by_tenant: dict[str, Shortfall] = {}

    def refused(self, who: Principal, cost: int, wait_s: float) -> None:
        """A take of `cost` was refused with `wait_s`: the bucket held `cost` less `wait_s` of refill."""
        if len(self._by_tenant) >= _MAX_TENANTS:
            self._by_tenant.clear()
        per_minute = who.tokens_per_minute
        self._by_tenant[who.tenant_id] = Shortfall(per_minute, cost - wait_s * per_minute / 60, time.monotonic())

    def certain_wait(self, who: Principal, cost: int) -> float | None:
        """`certain_wait` for a call of `who` carrying `cost` tokens, now."""
        if cost <= 0:
            return None
        return certain_wait(self._by_tenant.get(who.tenant_id), who.tokens_per_minute, cost, time.monotonic())


SHORTFALLS = Shortfalls()
