"""A private asyncio event loop on a background thread.

Every network operation of the SDK is a coroutine that runs on this loop. The sync API blocks
on it, the async API awaits it from the caller's own loop, so both share one code path and a
long-running poll keeps going while user code computes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from .errors import QuiltError

T = TypeVar("T")


class LoopThread:
    """Owns one event loop running forever on a daemon thread until :meth:`stop`."""

    def __init__(self, name: str = "quilt-loop") -> None:
        self._loop = asyncio.new_event_loop()
        self._stopped = False
        # Daemon, so a script that forgets close() can still exit.
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The background loop (for code already running on it)."""
        return self._loop

    def in_loop_thread(self) -> bool:
        """True when called from the loop's own thread."""
        return threading.get_ident() == self._thread.ident

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; safe from any thread, including the loop's own."""
        if self._stopped:
            coro.close()
            raise QuiltError("This quilt.Client is closed; create a new one.")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and block until it finishes (the sync API)."""
        if self.in_loop_thread():
            coro.close()
            # Blocking here would wait on ourselves forever.
            raise RuntimeError("Sync quilt call made on the SDK's own event loop; use the *_async method.")
        return self.submit(coro).result()

    async def run_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and await it from the caller's loop (the async API)."""
        return await asyncio.wrap_future(self.submit(coro))

    def stop(self) -> None:
        """Cancel what still runs on the loop, stop it and join the thread. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if not self.in_loop_thread():
            asyncio.run_coroutine_threadsafe(_cancel_others(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        if not self.in_loop_thread():
            self._thread.join()
            self._loop.close()


async def _cancel_others() -> None:
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current]
    for task in tasks:
        task.cancel()
    # Let them unwind so the loop closes without "Task was destroyed but it is pending".
    await asyncio.gather(*tasks, return_exceptions=True)
