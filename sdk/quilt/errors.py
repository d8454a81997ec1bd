"""Exceptions raised by the Quilt SDK.

Every exception the SDK raises on purpose derives from :class:`QuiltError`::

    QuiltError
    ├── ConfigurationError        bad client settings, e.g. a key without "tml-" (also a ValueError)
    ├── APIConnectionError        the server could not be reached
    │   └── APITimeoutError           ... or did not answer in time
    ├── APIResponseError          the server answered something the SDK cannot read
    ├── APIStatusError            the server answered with HTTP 4xx / 5xx
    │   ├── BadRequestError           400, 413, 422
    │   ├── AuthenticationError       401, or no API key configured (status_code is None)
    │   ├── BudgetExceededError       402
    │   ├── PermissionDeniedError     403
    │   ├── NotFoundError             404
    │   ├── RateLimitError            429
    │   └── InternalServerError       >= 500
    └── RequestFailedError        an accepted request failed while it ran (a failed future)
        ├── UserRequestError          category "user": the request itself must change
        └── ServerRequestError        category "server": not your fault; retry or report

``category`` is ``"user"``, ``"server"`` or ``"unknown"`` everywhere it appears, so one
``except`` clause can tell "fix my input" from "try again later".

All exceptions survive pickling (multiprocessing, Celery), which plain keyword-only
exception constructors would not.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "QuiltError",
    "ConfigurationError",
    "APIConnectionError",
    "APITimeoutError",
    "APIResponseError",
    "APIStatusError",
    "BadRequestError",
    "AuthenticationError",
    "BudgetExceededError",
    "PermissionDeniedError",
    "NotFoundError",
    "RateLimitError",
    "InternalServerError",
    "RequestFailedError",
    "UserRequestError",
    "ServerRequestError",
    "error_from_response",
]

_CATEGORIES = ("user", "server", "unknown")


def _rebuild(cls: type[QuiltError], kwargs: dict[str, Any]) -> QuiltError:
    return cls(**kwargs)


class QuiltError(Exception):
    """Base class of every error the Quilt SDK raises; ``.message`` holds the plain text."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def _init_kwargs(self) -> dict[str, Any]:
        return {"message": self.message}

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception's default pickling replays self.args positionally, which loses the
        # extra attributes; rebuild from the constructor arguments instead.
        return (_rebuild, (type(self), self._init_kwargs()))


class ConfigurationError(QuiltError, ValueError):
    """The client was configured with a value it cannot use (checked before any request)."""


class APIConnectionError(QuiltError):
    """The server could not be reached (refused, reset, DNS failure, ...)."""


class APITimeoutError(APIConnectionError):
    """The server accepted the connection but did not answer in time."""


class APIResponseError(QuiltError):
    """The server answered with a body the SDK cannot interpret (not JSON, missing fields)."""


_HINTS = {
    401: "Check that QUILT_API_KEY (or api_key=) holds a valid key for this server.",
    402: "The budget for this key is spent; ask your tenant admin to raise it.",
    403: "This key may not do that; ask your tenant admin for the right role.",
    429: "You are sending too fast; the SDK already retried. Slow down and try again.",
}
_SERVER_HINT = "The server failed; retry later and report the request_id if it persists."


class APIStatusError(QuiltError):
    """The server answered with an HTTP error status.

    Attributes:
        status_code: the HTTP status (None only for a client-side AuthenticationError).
        message: the server's ``detail`` text.
        request_id: the server's id for the failed request, for bug reports.
        category: ``"user"`` (4xx), ``"server"`` (5xx) or ``"unknown"``.
        field: the request field the server blamed, when it named one.
    """

    def __init__(
        self,
        status_code: int | None,
        message: str,
        request_id: str | None = None,
        category: str | None = None,
        *,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.request_id = request_id
        self.category = category if category in _CATEGORIES else _category_for(status_code)
        self.field = field

    def _init_kwargs(self) -> dict[str, Any]:
        return {
            "status_code": self.status_code,
            "message": self.message,
            "request_id": self.request_id,
            "category": self.category,
            "field": self.field,
        }

    def __str__(self) -> str:
        facts = [f"HTTP {self.status_code}"] if self.status_code is not None else []
        if self.field:
            facts.append(f"field={self.field}")
        if self.request_id:
            facts.append(f"request_id={self.request_id}")
        text = f"{self.message} [{', '.join(facts)}]" if facts else self.message
        hint = _HINTS.get(self.status_code or 0)
        if hint is None and (self.status_code or 0) >= 500:
            hint = _SERVER_HINT
        return f"{text}\n  {hint}" if hint else text


class BadRequestError(APIStatusError):
    """The server rejected the request as malformed or too large (400, 413, 422)."""


class AuthenticationError(APIStatusError):
    """The API key is missing (raised before any request) or was refused (401)."""


class BudgetExceededError(APIStatusError):
    """The tenant's budget is exhausted (402); the message names the budget."""


class PermissionDeniedError(APIStatusError):
    """The key is valid but may not perform this action (403)."""


class NotFoundError(APIStatusError):
    """The model, session, future or route does not exist for this key (404)."""


class RateLimitError(APIStatusError):
    """Too many requests (429), still refused after the SDK's retries."""


class InternalServerError(APIStatusError):
    """The server failed (5xx), still failing after the SDK's retries."""


_STATUS_CLASSES: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    402: BudgetExceededError,
    403: PermissionDeniedError,
    404: NotFoundError,
    413: BadRequestError,
    422: BadRequestError,
    429: RateLimitError,
}


def _category_for(status_code: int | None) -> str:
    if status_code is None:
        return "user"
    if 400 <= status_code < 500:
        return "user"
    if status_code >= 500:
        return "server"
    return "unknown"


def _detail_text(detail: Any) -> str | None:
    if detail is None or isinstance(detail, str):
        return detail
    # FastAPI's own validation errors arrive as a list of {"loc", "msg", ...} objects.
    if isinstance(detail, list):
        parts = []
        for item in detail:
            if isinstance(item, dict) and "msg" in item:
                loc = ".".join(str(p) for p in item.get("loc", ()))
                parts.append(f"{loc}: {item['msg']}" if loc else str(item["msg"]))
            else:
                parts.append(str(item))
        return "; ".join(parts)
    return str(detail)


def error_from_response(
    status_code: int, body: Any, header_request_id: str | None = None
) -> APIStatusError:
    """Build the typed exception for an HTTP error answer.

    ``body`` is the decoded JSON (``{"detail", "category", "request_id", "field"?}``) or
    whatever could be read; ``header_request_id`` is the ``X-Request-ID`` header.
    """
    fields = body if isinstance(body, dict) else {}
    message = _detail_text(fields.get("detail", fields.get("message", fields.get("error"))))
    if not message:
        message = body if isinstance(body, str) and body else f"HTTP {status_code} from server"
    if status_code >= 500:
        cls: type[APIStatusError] = InternalServerError
    else:
        cls = _STATUS_CLASSES.get(status_code, APIStatusError)
    return cls(
        status_code,
        message,
        fields.get("request_id") or header_request_id,
        fields.get("category"),
        field=fields.get("field"),
    )


class RequestFailedError(QuiltError):
    """A request was accepted but failed while running; raised by ``APIFuture.result()``.

    Attributes:
        message: the server's error text.
        request_id: the id of the failed request.
        category: ``"user"``, ``"server"`` or ``"unknown"``.
        field: the request field the failure is about, when the server names one (for example
            ``"deadline_s"`` for a sampling request aborted at its deadline).

    Instances created through :meth:`from_answer` are :class:`UserRequestError` or
    :class:`ServerRequestError` when the category says so.
    """

    def __init__(self, message: str, request_id: str | None = None, category: str = "unknown",
                 field: str | None = None):
        super().__init__(message)
        self.request_id = request_id
        self.category = category if category in _CATEGORIES else "unknown"
        self.field = field

    @classmethod
    def from_answer(cls, answer: dict[str, Any], request_id: str) -> RequestFailedError:
        """Build the error for a ``retrieve_future`` answer that carries an ``"error"`` key."""
        error = answer.get("error")
        message = error if isinstance(error, str) else str(error)
        category = answer.get("category", "unknown")
        sub = {"user": UserRequestError, "server": ServerRequestError}.get(category, cls)
        field = answer.get("field")
        return sub(message, answer.get("request_id") or request_id, category, field if isinstance(field, str) else None)

    def _init_kwargs(self) -> dict[str, Any]:
        return {"message": self.message, "request_id": self.request_id, "category": self.category,
                "field": self.field}

    def __str__(self) -> str:
        return f"{self.message} [category={self.category}, request_id={self.request_id}]"


class UserRequestError(RequestFailedError):
    """A failed request whose input was at fault (category ``"user"``); fix it, don't retry."""


class ServerRequestError(RequestFailedError):
    """A failed request that the server could not complete (category ``"server"``)."""
