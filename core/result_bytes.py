"""Bytes of Redis a tenant's stored results take: counted as they are stored, bounded per tenant.

Every stored future (core.queue.publish) and every streamed token entry (core.queue.delta_key)
adds its size to the tenant's counter for the current hour; the counters live as long as what
they count (a result's TTL, plus an hour). After each addition the tenant's total over the hours a
result can still live is compared with QUILT_TENANT_MAX_RESULT_BYTES, and while it is past it an
`over` flag (the total) is kept for a minute, refreshed by each further addition. Admission's
append refuses a tenant's new work while its flag is set (core.queue.enqueue: 429 naming
`result_bytes`), so one tenant cannot fill the Redis every tenant's futures live in; what it has
stored ages out with its TTL.

The total is an upper bound (a result retrieved early still counts until it expires), and work
admitted before the flag was set may still add to it: the bound is soft by what is in flight.
"""

from __future__ import annotations

import math
import time
from typing import Any

HOUR_S = 3600
OVER_FLAG_S = 60

# KEYS[1] this hour's counter, KEYS[2] the over flag, KEYS[3..] every counter still alive (this
# hour's included); ARGV: bytes, the counter's TTL, the cap. Returns the total.
_NOTE = """
redis.call('INCRBY', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
local total = 0
for i = 3, #KEYS do total = total + (tonumber(redis.call('GET', KEYS[i])) or 0) end
if total > tonumber(ARGV[3]) then
  redis.call('SET', KEYS[2], tostring(total), 'EX', %d)
end
return total
""" % OVER_FLAG_S


def over_key(tenant_id: str) -> str:
    return f"quilt:rbytes-over:{tenant_id}"


def _counter(tenant_id: str, hour: int) -> str:
    return f"quilt:rbytes:{tenant_id}:{hour}"


def keys(tenant_id: str, ttl_s: int, now: float | None = None) -> list[str]:
    """This hour's counter, the over flag, then every counter a result stored now could share the
    Redis with (the hours of one TTL back)."""
    hour = int((time.time() if now is None else now) // HOUR_S)
    alive = [_counter(tenant_id, hour - back) for back in range(math.ceil(ttl_s / HOUR_S) + 1)]
    return [alive[0], over_key(tenant_id), *alive]


def note(redis: Any, tenant_id: str, nbytes: int, ttl_s: int, cap: int) -> Any:
    """Count `nbytes` stored for `tenant_id` for `ttl_s` (a pipeline or a client, sync or async:
    what it returns is awaited or executed by the caller)."""
    ks = keys(tenant_id, ttl_s)
    return redis.eval(_NOTE, len(ks), *ks, str(nbytes), str(ttl_s + HOUR_S), str(cap))
