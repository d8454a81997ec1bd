"""Tokens per minute: one token bucket per tenant in Redis, shared by every API replica.

The bucket holds up to a minute of the tenant's `tokens_per_minute` and refills continuously. A
call takes its tokens at admission (training: model-input tokens; sampling: prompt tokens plus
`max_tokens` for each sample, what it may consume), or takes nothing and learns how many seconds
until it could: the 429's `Retry-After`. The check and the take are one Lua script on Redis' own
clock, so replicas never race or disagree on the time. A call that took its tokens and was then
refused or found to be a retry of one admitted before gives them back (`give_back`).
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

# KEYS[1]: the bucket; ARGV: per-minute rate, cost (negative: tokens given back, never past a full
# bucket). Returns {admitted (1/0), tokens left or seconds to wait}.
_TAKE = """
local per_minute = tonumber(ARGV[1])
local cost = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(state[1]) or per_minute
local at = tonumber(state[2]) or now
tokens = math.min(per_minute, tokens + math.max(0, now - at) * per_minute / 60)
if cost > tokens then
  return {0, tostring((cost - tokens) * 60 / per_minute)}
end
tokens = math.min(per_minute, tokens - cost)
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('EXPIRE', KEYS[1], 120)
return {1, tostring(tokens)}
"""


def bucket_key(tenant_id: str) -> str:
    return f"quilt:tpm:{tenant_id}"


@dataclass(frozen=True)
class Decision:
    admitted: bool
    retry_after_s: float = 0.0  # when refused: until the bucket holds the cost again


async def take(redis: Redis, tenant_id: str, *, per_minute: int, cost: int) -> Decision:
    """Take `cost` tokens from the tenant's bucket, or refuse with the wait. The caller refuses
    costs above `per_minute` first: the bucket never holds more than a minute's worth."""
    admitted, value = await redis.eval(_TAKE, 1, bucket_key(tenant_id), per_minute, cost)
    return Decision(True) if int(admitted) else Decision(False, float(value))


async def give_back(redis: Redis, tenant_id: str, *, per_minute: int, cost: int) -> None:
    """Return `cost` tokens taken by a call that was then not admitted (never past a full bucket)."""
    await redis.eval(_TAKE, 1, bucket_key(tenant_id), per_minute, -cost)
