"""HTTP to the Quilt server: one httpx.AsyncClient, typed errors, retries.

The ``transport`` given to :class:`quilt.Client` ends up here, so tests can swap the network
for ``httpx.MockTransport``.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import time
from typing import Any

import httpx

from ._config import ClientConfig, RetryPolicy
from ._version import __version__
from .errors import (
    APIConnectionError,
    APIResponseError,
    APIStatusError,
    APITimeoutError,
    error_from_response,
)

log = logging.getLogger("quilt")

_RETRYABLE_STATUS = frozenset({408, 429})


def _is_retryable(status_code: int) -> bool:
    return status_code in _RETRYABLE_STATUS or status_code >= 500


def _retry_after_s(headers: httpx.Headers) -> float | None:
    """Seconds the server asked us to wait (``Retry-After-Ms`` or ``Retry-After``), if any."""
    millis = headers.get("retry-after-ms")
    if millis:
        try:
            return float(millis) / 1000
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _decode(response: httpx.Response) -> Any:
    if not response.content:
        return {}
    try:
        return response.json()
    except ValueError as exc:
        raise APIResponseError(
            f"{response.request.method} {response.request.url.path} answered "
            f"HTTP {response.status_code} with a body that is not JSON: {response.text[:200]!r}"
        ) from exc


class HTTPTransport:
    """Sends JSON requests to ``{base_url}/api/v1/<name>`` and decodes the answers.

    Must be used from the SDK's event loop only (httpx.AsyncClient is bound to one loop).
    ``retry`` can be replaced after construction (tests use a zero-delay policy).
    """

    def __init__(
        self, config: ClientConfig, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.config = config
        self.retry: RetryPolicy = config.retry
        self._client = httpx.AsyncClient(
            transport=transport,
            headers={
                "X-API-Key": config.api_key,
                "Accept": "application/json",
                "User-Agent": f"quilt-sdk/{__version__}",
            },
            timeout=httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s),
            follow_redirects=True,
        )

    async def request(
        self,
        method: str,
        name: str,
        body: Any = None,
        *,
        retry: bool = True,
        timeout_s: float | None = None,
    ) -> Any:
        """Send one API call and return its decoded JSON body.

        With ``retry`` (the default) connection errors, 408, 429 and 5xx are retried with
        backoff, obeying ``Retry-After``. Raises the APIStatusError subclass for the status,
        APIConnectionError / APITimeoutError, or APIResponseError for an unreadable body.
        """
        attempt = 0
        started = time.monotonic()

        def may_retry(delay: float, unavailable: bool) -> bool:
            if not retry:
                return False
            if unavailable and time.monotonic() - started + delay <= self.retry.unavailable_max_s:
                return True
            return attempt < self.retry.max_retries

        while True:
            try:
                response = await self._send(method, name, body, timeout_s)
            except APIConnectionError as exc:
                delay = self.retry.delay_s(attempt)
                if not may_retry(delay, unavailable=True):
                    raise
                log.info("Retrying %s in %.2fs after: %s", name, delay, exc.message)
            else:
                if response.is_success:
                    return _decode(response)
                error = self._error(response)
                delay = self.retry.delay_s(attempt, _retry_after_s(response.headers))
                if not _is_retryable(response.status_code) or not may_retry(
                    delay, unavailable=response.status_code == 503
                ):
                    raise error
                log.info("Retrying %s in %.2fs after HTTP %d", name, delay, response.status_code)
            attempt += 1
            await asyncio.sleep(delay)

    async def _send(
        self, method: str, name: str, body: Any, timeout_s: float | None
    ) -> httpx.Response:
        url = self.config.url(name)
        timeout: Any = httpx.USE_CLIENT_DEFAULT
        if timeout_s is not None:
            timeout = httpx.Timeout(timeout_s, connect=self.config.connect_timeout_s)
        try:
            return await self._client.request(
                method, url, json=body if method != "GET" else None, timeout=timeout
            )
        except httpx.TimeoutException as exc:
            raise APITimeoutError(
                f"{method} {url} got no answer in time ({type(exc).__name__}). The server may be "
                "overloaded; retry, or pass a larger timeout= to quilt.Client."
            ) from exc
        except httpx.TransportError as exc:
            raise APIConnectionError(
                f"Could not reach the Quilt server at {self.config.base_url} ({exc or type(exc).__name__}). "
                "Is it running? Set QUILT_BASE_URL or pass base_url= to quilt.Client."
            ) from exc

    @staticmethod
    def _error(response: httpx.Response) -> APIStatusError:
        try:
            body: Any = response.json() if response.content else None
        except ValueError:
            body = response.text[:500]
        return error_from_response(
            response.status_code, body, response.headers.get("x-request-id")
        )

    async def aclose(self) -> None:
        """Close the pooled connections."""
        await self._client.aclose()
