"""Open long-polls per tenant, per API process.

A long-poll (`retrieve_future`, `retrieve_futures`) holds one of the process's 256 Redis
connections while it waits; without a bound, one tenant's polls could take them all and every
other caller would get 503. Past QUILT_LONG_POLLS_PER_TENANT open at once, a tenant's next poll is
a 429 with Retry-After (the SDKs retry it), and other tenants are untouched.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncIterator

from core.errors import QuotaExceeded

_open: Counter[str] = Counter()


@contextlib.asynccontextmanager
async def held(tenant_id: str, limit: int) -> AsyncIterator[None]:
    """Count one open long-poll of the tenant for the block, or refuse it (429) past `limit`."""
    if _open[tenant_id] >= limit:
        raise QuotaExceeded(f"{limit} long-polls of your tenant are already open on this server; wait for "
                            "their answers (or poll fewer futures at once) and retry", field="long_polls",
                            retry_after_s=1.0)
    _open[tenant_id] += 1
    try:
        yield
    finally:
        _open[tenant_id] -= 1
        if not _open[tenant_id]:
            del _open[tenant_id]
