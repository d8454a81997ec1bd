"""`X-Quilt-Spend-USD`: the caller's tenant's spend this UTC month, on every authenticated response.

Pure ASGI middleware: it adds the header when the response starts, once authentication has put
the tenant on `request.state` (so long-polls report the spend at the moment they answer, and
responses without a known tenant, such as a 401, carry no header). The amount is exact decimal
USD with six places ("0.001234"); it counts completed requests only, not work still in flight.
"""

from __future__ import annotations

import logging
import time

from api import caller_cache
from billing.pricing import usd

log = logging.getLogger("quilt.api")

SPEND_HEADER = b"x-quilt-spend-usd"


class SpendHeaderMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_spend(message):
            if message["type"] == "http.response.start":
                state = scope.get("state") or {}
                tenant_id = state.get("tenant_id")
                if tenant_id:
                    read, at = state.get("spend") or (None, 0.0)
                    fresh = read is not None and time.monotonic() - at < FRESH_S
                    spend = read if fresh else await _spend(scope, tenant_id)
                    if spend is not None:
                        message = {**message, "headers": [*message.get("headers", []),
                                                          (SPEND_HEADER, usd(spend).encode())]}
            await send(message)

        await self.app(scope, receive, send_with_spend)


# The key lookup reads the spend too (api.deps); an answer that starts within this long of it uses
# that figure, a later one (a long poll) asks again (api.caller_cache, else Postgres).
FRESH_S = 1.0


async def _spend(scope, tenant_id: str) -> int | None:
    state = scope["app"].state
    try:
        return await caller_cache.spend(state.callers, state.pool, tenant_id)
    except Exception:  # the header is informative; never fail a response for it
        log.warning("could not read the spend of %s for the spend header", tenant_id, exc_info=True)
        return None
