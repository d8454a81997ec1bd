"""Typed errors shared by the API, the workers and Celery tasks.

    QuiltError                    base; every error has a category and may carry a request id
    ├── UserError                 the caller's fault: 4xx, or a failed future of category "user"
    │   ├── InvalidInput          a field breaks a rule (names the field and the limit)   400
    │   ├── PayloadTooLarge       body over the size limit                                413
    │   ├── Unauthenticated       missing, unknown or revoked API key                     401
    │   │   └── InvalidToken      an auth token that is malformed, forged, expired,       401
    │   │                         rotated out, or whose key is revoked (RFC 6750 header)
    │   ├── BudgetExceeded        a monthly spend limit is reached (names it, its fix)    402
    │   ├── Forbidden             authenticated, but the role does not allow it           403
    │   ├── NotFound              no such resource *for this tenant*                      404
    │   ├── Conflict              a name is already taken (reported in the future)        409
    │   └── QuotaExceeded         quota or rate limit                                     429
    └── ServerError               our fault: 500, or a failed future of category "server"
        └── Unavailable           Postgres or Redis cannot be reached; retry               503

They are plain picklable exceptions (Celery pickles them): every constructor argument is stored in
`self.args`.
"""

from __future__ import annotations

from typing import Any, Literal

Category = Literal["user", "server"]


class QuiltError(Exception):
    category: Category = "server"
    status_code: int = 500

    def __init__(self, message: str, *, field: str | None = None, request_id: str | None = None):
        super().__init__(message, field, request_id)
        self.message = message
        self.field = field
        self.request_id = request_id

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self.field, self.request_id))

    def __str__(self) -> str:
        return self.message

    def to_json(self) -> dict[str, Any]:
        """The body of an HTTP error and of a failed future (Tinker shape plus our fields)."""
        body: dict[str, Any] = {"error": self.message, "detail": self.message, "category": self.category}
        if self.field:
            body["field"] = self.field
        if self.request_id:
            body["request_id"] = self.request_id
        return body


def _rebuild(cls: type[QuiltError], message: str, field: str | None, request_id: str | None) -> QuiltError:
    return cls(message, field=field, request_id=request_id)


class UserError(QuiltError):
    category: Category = "user"
    status_code = 400


class InvalidInput(UserError):
    status_code = 400


class PayloadTooLarge(UserError):
    status_code = 413


class Unauthenticated(UserError):
    status_code = 401


class InvalidToken(Unauthenticated):
    """A bearer token the server will not honour. Answered with `WWW-Authenticate: Bearer
    error="invalid_token"`, which tells the tinker SDK to exchange its API key for a new token and
    replay the call once, where a plain 401 would end the call."""

    www_authenticate = 'Bearer error="invalid_token"'


class BudgetExceeded(UserError):
    status_code = 402


class Forbidden(UserError):
    status_code = 403


class NotFound(UserError):
    status_code = 404


class Conflict(UserError):
    status_code = 409


class QuotaExceeded(UserError):
    status_code = 429

    def __init__(self, message: str, *, field: str | None = None, request_id: str | None = None,
                 retry_after_s: float = 1.0):
        super().__init__(message, field=field, request_id=request_id)
        self.retry_after_s = retry_after_s  # the HTTP answer's Retry-After (not carried through Celery)


class ServerError(QuiltError):
    category: Category = "server"
    status_code = 500


class Unavailable(ServerError):
    """A store (Postgres, Redis) cannot be reached: retry after a moment."""

    status_code = 503


def failure_from_json(body: dict[str, Any]) -> QuiltError:
    """Rebuild a typed error from a stored failed-future body."""
    cls = UserError if body.get("category") == "user" else ServerError
    return cls(body.get("error", "unknown error"), field=body.get("field"), request_id=body.get("request_id"))
