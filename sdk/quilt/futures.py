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

__all__ = ["APIFuture", "SessionPoller", "retrieve_result"]

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


class SessionPoller:
    """One ``retrieve_futures`` long-poll for all of a sampling session's requests in flight, in
    place of one ``retrieve_future`` poll each; it also tells the server which results were read,
    so their storage is freed at once. Lives on the SDK's loop. A server without the route (404),
    or polling that still fails after the transport's retries, turns it off for good: each request
    then polls ``retrieve_future`` itself, as before."""

    def __init__(self, http: HTTPTransport, sampling_session_id: str) -> None:
        self._http = http
        self._target = {"type": "sampling_session", "sampling_session_id": sampling_session_id,
                        "cloned_sampler_id": 0}
        self._cursor = 0
        self._waiting: dict[str, asyncio.Future[None]] = {}
        self._seen: set[str] = set()  # finished before their future began to wait
        self._retrieved: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self.off = False

    async def wait(self, request_id: str) -> None:
        """Return once the request has finished or failed, or at once when the poller is off."""
        if self.off:
            return
        if request_id in self._seen:
            self._seen.discard(request_id)
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = waiter
        self._start()
        try:
            await waiter
        finally:
            self._waiting.pop(request_id, None)

    def retrieved(self, request_id: str) -> None:
        """The request's result has been read for good: the next poll says so."""
        if not self.off:
            self._retrieved.add(request_id)
            self._start()

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            while self._waiting or self._retrieved:
                acks = sorted(self._retrieved)
                body = {"target": self._target, "prev_cursor": self._cursor, "retrieved_request_ids": acks,
                        "timeout": None if self._waiting else 0}  # nothing to wait for: report and return
                answer = await self._http.request("POST", "retrieve_futures", body,
                                                  timeout_s=self._http.config.long_poll_timeout_s)
                self._retrieved.difference_update(acks)
                self._cursor = int(require(answer, "cursor", "retrieve_futures"))
                for done in answer.get("completions") or []:
                    request_id = str(done.get("request_id"))
                    waiter = self._waiting.pop(request_id, None)
                    if waiter is None:
                        self._seen.add(request_id)
                    elif not waiter.done():
                        waiter.set_result(None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure falls back to per-request polling
            log.info("session poll for %s off (%s: %s); polling each request instead",
                     self._target["sampling_session_id"], type(exc).__name__, exc)
            self.off = True
            for waiter in self._waiting.values():
                if not waiter.done():
                    waiter.set_result(None)


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
        poller: SessionPoller | None = None,
    ) -> APIFuture[T]:
        """Start polling ``request_id`` via ``submit`` (the loop's scheduler); results pass ``convert``.
        ``cancellable``: the server can abort this kind of request (sampling). ``poller``: the
        sampling session's poll, which says when to read the result."""

        async def resolve() -> T:
            if poller is not None:
                await poller.wait(request_id)
            result = await retrieve_result(http, request_id)
            if poller is not None:
                poller.retrieved(request_id)
            return convert(result)

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
