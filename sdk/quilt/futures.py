"""Futures: a handle on a request the server accepted and is still working on.

The server answers a submission at once with a ``request_id``; the result is fetched with
``POST /api/v1/retrieve_future``, which the server holds open (long-poll) until the work is done
or about 30 s passed (then ``{"type": "try_again"}``). Polling starts as soon as the request is
submitted, on the SDK's background loop, so many futures progress while user code runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

from ._transport import HTTPTransport
from .errors import APIResponseError, RequestFailedError

__all__ = ["APIFuture", "retrieve_result"]

T = TypeVar("T")
log = logging.getLogger("quilt")


async def retrieve_result(http: HTTPTransport, request_id: str) -> dict[str, Any]:
    """Poll ``retrieve_future`` until the request finishes; return its result JSON.

    ``try_again`` answers are polled again at once (the server already waited). Raises
    RequestFailedError (UserRequestError / ServerRequestError) for a failed request, and the
    transport's errors when polling itself fails after retries.
    """
    polls = 0
    while True:
        answer = await http.request(
            "POST",
            "retrieve_future",
            {"request_id": request_id, "allow_metadata_only": False},
            timeout_s=http.config.long_poll_timeout_s,
        )
        polls += 1
        if not isinstance(answer, dict):
            raise APIResponseError(f"retrieve_future for {request_id} answered {answer!r}")
        if answer.get("type") == "try_again":
            log.debug("%s still pending (poll %d, queue %s)", request_id, polls, answer.get("queue_state"))
            # A server that answers try_again without holding the poll would otherwise starve
            # every other task on the SDK loop (heartbeat, close) in a tight loop.
            await asyncio.sleep(0)
            continue
        if "error" in answer:
            raise RequestFailedError.from_answer(answer, request_id)
        return answer


def require(answer: Any, key: str, what: str) -> Any:
    """``answer[key]``, or APIResponseError naming the call that left it out."""
    if not isinstance(answer, dict) or answer.get(key) is None:
        raise APIResponseError(f"{what} answer has no {key!r}: {answer!r}")
    return answer[key]


class APIFuture(Generic[T]):
    """The eventual result of one request.

    Wait for it with ``future.result()`` (blocking, optional ``timeout`` in seconds) or
    ``await future`` in async code. Failures raise :class:`quilt.RequestFailedError`
    (category ``"user"`` or ``"server"``) or a transport error. Futures still pending when
    their client closes are cancelled.
    """

    def __init__(self, request_id: str, future: concurrent.futures.Future[T],
                 canceller: Callable[[], concurrent.futures.Future[Any]] | None = None) -> None:
        self._request_id = request_id
        self._future = future
        self._canceller = canceller

    @classmethod
    def poll(
        cls,
        submit: Callable[[Any], concurrent.futures.Future[Any]],
        http: HTTPTransport,
        request_id: str,
        convert: Callable[[dict[str, Any]], T],
        *,
        cancellable: bool = False,
    ) -> APIFuture[T]:
        """Start polling ``request_id`` via ``submit`` (the loop's scheduler); results pass ``convert``.
        ``cancellable``: the server can abort this kind of request (sampling)."""

        async def resolve() -> T:
            return convert(await retrieve_result(http, request_id))

        async def abort() -> Any:
            return await http.request("POST", "cancel_future", {"request_id": request_id})

        return cls(request_id, submit(resolve()), (lambda: submit(abort())) if cancellable else None)

    def cancel(self) -> concurrent.futures.Future[Any]:
        """Ask the server to abort the request (sampling requests only) and return at once.

        The server stops its sequences, frees their slots for other work and does not bill it;
        this future then fails with a ``cancelled`` user error. The returned future resolves to the
        server's acknowledgement (wait on it or not). A finished request is left as it is.
        """
        if self._canceller is None:
            raise TypeError(f"request {self._request_id} cannot be cancelled (only sampling requests can)")
        return self._canceller()

    @property
    def request_id(self) -> str:
        """The server's id for this request (quote it in bug reports)."""
        return self._request_id

    def done(self) -> bool:
        """True once the result (or error) is known."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> T:
        """Block until the request finishes and return its result.

        Raises TimeoutError if ``timeout`` seconds pass first; the request keeps running and
        ``result()`` may be called again.
        """
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            # Separate class before Python 3.11; give every version the builtin.
            raise TimeoutError(
                f"Request {self._request_id} still running after {timeout}s; "
                "call .result() again to keep waiting."
            ) from None

    def __await__(self) -> Generator[Any, None, T]:
        return asyncio.wrap_future(self._future).__await__()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<APIFuture {self._request_id} {state}>"
