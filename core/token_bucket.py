"""One token bucket, in Lua on Redis' own clock: a function for the scripts that take tokens.

The append of a call's stream entry runs it, taking the call's tokens per minute in the same step
(core.queue.enqueue; the tenants' buckets are tenancy.rate_limit's). A bucket holds up to
`per_minute` tokens and refills continuously; a take either fits and is taken, or takes nothing
and answers the seconds until it would fit.
"""

# take_tokens(key, per_minute, cost) -> 1, tokens left | 0, seconds to wait.
LUA = """
local function take_tokens(key, per_minute, cost)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
  local state = redis.call('HMGET', key, 'tokens', 'at')
  local tokens = tonumber(state[1]) or per_minute
  local at = tonumber(state[2]) or now
  tokens = math.min(per_minute, tokens + math.max(0, now - at) * per_minute / 60)
  if cost > tokens then
    return 0, (cost - tokens) * 60 / per_minute
  end
  tokens = tokens - cost
  redis.call('HSET', key, 'tokens', tostring(tokens), 'at', tostring(now))
  redis.call('EXPIRE', key, 120)
  return 1, tokens
end
"""
