"""Client settings: which server, which key, how long to wait and how hard to retry.

Built by :func:`resolve_config` when a :class:`quilt.Client` is constructed, never at import
time, so environment variables set after ``import quilt`` still count.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from .errors import AuthenticationError, ConfigurationError

API_KEY_ENV = "QUILT_API_KEY"
BASE_URL_ENV = "QUILT_BASE_URL"
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
API_KEY_PREFIX = "tml-"


@dataclass(frozen=True)
class RetryPolicy:
    """How submissions are retried after connection errors, 408, 429 and 5xx answers.

    Attributes:
        max_retries: extra attempts after the first one (0 disables retries).
        backoff_base_s: delay before the first retry, in seconds; doubles each attempt.
        backoff_max_s: ceiling of the exponential delay, in seconds.
        retry_after_max_s: a server ``Retry-After`` up to this many seconds is obeyed as is;
            longer values fall back to the exponential delay so a client never sleeps for hours.
        unavailable_max_s: a server that answers 503 (a store restarting, a deploy) or cannot be
            reached is retried for this many seconds in all, however many attempts that takes;
            other errors stop after ``max_retries``.
    """

    max_retries: int = 4
    backoff_base_s: float = 0.5
    backoff_max_s: float = 8.0
    retry_after_max_s: float = 60.0
    unavailable_max_s: float = 120.0

    def delay_s(self, attempt: int, retry_after_s: float | None = None) -> float:
        """Seconds to wait before retry number ``attempt + 1`` (``attempt`` counts from 0)."""
        if retry_after_s is not None and 0 <= retry_after_s <= self.retry_after_max_s:
            return float(retry_after_s)
        delay = min(self.backoff_base_s * 2.0**attempt, self.backoff_max_s)
        # Jitter so many clients hit by the same outage do not retry in lock-step.
        return delay * (1 - 0.25 * random.random())


@dataclass(frozen=True)
class ClientConfig:
    """Resolved settings of one :class:`quilt.Client`.

    Attributes:
        api_key: the ``tml-`` key sent as ``X-API-Key`` (hidden from repr).
        base_url: server root without trailing slash; routes are ``{base_url}/api/v1/<name>``.
        timeout_s: read timeout of ordinary requests, seconds (> 0).
        connect_timeout_s: TCP connect timeout, seconds (> 0).
        long_poll_timeout_s: read timeout of ``retrieve_future``; the server holds the poll
            for about 30 s, so this must stay above that.
        heartbeat_interval_s: seconds between session heartbeats.
        retry: the retry policy for submissions and polls.
    """

    api_key: str = field(repr=False)
    base_url: str
    timeout_s: float = 60.0
    connect_timeout_s: float = 5.0
    long_poll_timeout_s: float = 45.0
    heartbeat_interval_s: float = 10.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def url(self, name: str) -> str:
        """The absolute URL of API route ``name`` (e.g. ``"create_model"``)."""
        return f"{self.base_url}/api/v1/{name}"


def _env(environ: Mapping[str, str], name: str) -> str | None:
    # An empty variable counts as unset, as `QUILT_API_KEY= python train.py` intends.
    value = environ.get(name, "").strip()
    return value or None


def resolve_config(
    api_key: str | None = None,
    base_url: str | None = None,
    timeout: float = 60.0,
    environ: Mapping[str, str] | None = None,
) -> ClientConfig:
    """Combine explicit arguments, environment variables and defaults into a ClientConfig.

    Arguments win over ``QUILT_API_KEY`` / ``QUILT_BASE_URL``; the base URL defaults to
    ``http://127.0.0.1:8000``. Raises AuthenticationError when no key is found and
    ConfigurationError when the key or timeout cannot be used.
    """
    environ = os.environ if environ is None else environ
    key = api_key or _env(environ, API_KEY_ENV)
    if not key:
        raise AuthenticationError(
            None,
            f"No API key given. Set the {API_KEY_ENV} environment variable "
            f"(export {API_KEY_ENV}=tml-...) or pass quilt.Client(api_key=...).",
        )
    if not key.startswith(API_KEY_PREFIX):
        raise ConfigurationError(
            f"The API key must start with {API_KEY_PREFIX!r}; the one given does not. "
            f"Copy the full key shown when it was created into {API_KEY_ENV}."
        )
    url = (base_url or _env(environ, BASE_URL_ENV) or DEFAULT_BASE_URL).rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigurationError(
            f"base_url must start with http:// or https:// (got {url!r}); "
            f"check {BASE_URL_ENV} or the base_url= argument."
        )
    if not timeout or timeout <= 0:
        raise ConfigurationError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return ClientConfig(api_key=key, base_url=url, timeout_s=float(timeout))
