"""The worker side of the process-pool and Ray executors: environments live here, by id.

Only token ids, budgets and results cross to the trainer's process; the builder, the environments
and whatever they hold (sandboxes, datasets, graders) stay on the worker.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import threading
from typing import Any

from .bounds import EpisodeBudget
from .env import GroupBuilder, StepResult
from .starts import close_env, start_group

log = logging.getLogger("quilt.rl.worker")


def dumps(obj: Any) -> bytes:
    """Pickle a builder for another process: cloudpickle when installed (closures, lambdas,
    classes defined in ``__main__``), else the standard pickle (importable functions only)."""
    try:
        import cloudpickle
    except ImportError:
        return pickle.dumps(obj)
    return cloudpickle.dumps(obj)


class EnvHost:
    """Holds a worker's environments and answers the executor's calls about them."""

    def __init__(self) -> None:
        self.envs: dict[int, Any] = {}
        self.builders: dict[str, GroupBuilder] = {}
        self._ids = itertools.count(1)

    def register(self, key: str, builder: bytes | GroupBuilder) -> None:
        self.builders[key] = pickle.loads(builder) if isinstance(builder, bytes) else builder

    async def start_group(self, key: str, index: int, n: int, budget: EpisodeBudget, fork: bool) -> dict:
        group = await start_group(self.builders[key], index, n, budget, fork=fork)
        members = []
        for m in group.members:
            env_id = None
            if m.env is not None:
                env_id = next(self._ids)
                self.envs[env_id] = m.env
            members.append((env_id, m.prompt, m.error, m.cause, m.stop))
        return {"members": members, "start_s": group.start_s, "cold": group.cold, "forks": group.forks,
                "retries": dict(group.retries)}

    async def step(self, env_id: int, tokens: list[int]) -> StepResult:
        env = self.envs.get(env_id)
        if env is None:
            raise KeyError(f"environment {env_id} is not on this worker (closed, or the worker restarted)")
        return await env.step(tokens)

    async def close(self, env_ids: list[int]) -> None:
        envs = [self.envs.pop(env_id, None) for env_id in env_ids]
        await asyncio.gather(*(close_env(env) for env in envs if env is not None))


def serve(conn) -> None:
    """A process-pool worker's main: read calls from ``conn``, run each as a task, answer
    ``("ok", id, value)`` or ``("err", id, text)``. Ends when the trainer's end of the pipe closes."""
    logging.basicConfig(level=logging.WARNING)
    loop = asyncio.new_event_loop()
    host = EnvHost()
    tasks: dict[int, asyncio.Task] = {}
    lock = threading.Lock()

    def send(message) -> None:
        try:
            with lock:
                conn.send(message)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:  # an unpicklable answer
            with lock:
                conn.send(("err", message[1], f"answer could not be sent: {type(exc).__name__}: {exc}"))

    async def run(call_id: int, op: str, args: tuple) -> None:
        try:
            result = getattr(host, op)(*args)
            if asyncio.iscoroutine(result):
                result = await result
            send(("ok", call_id, result))
        except asyncio.CancelledError:
            send(("err", call_id, "cancelled"))
        except Exception as exc:
            send(("err", call_id, f"{type(exc).__name__}: {exc}"))
        finally:
            tasks.pop(call_id, None)

    def dispatch(message) -> None:
        op, call_id, args = message
        if op == "stop":
            loop.stop()
            return
        if op == "cancel":
            task = tasks.get(call_id)
            if task is not None:
                task.cancel()
            return
        tasks[call_id] = loop.create_task(run(call_id, op, args))

    def reader() -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the trainer's process went away: so does this one
                loop.call_soon_threadsafe(loop.stop)
                return
            loop.call_soon_threadsafe(dispatch, message)

    threading.Thread(target=reader, name="quilt-env-reader", daemon=True).start()
    try:
        loop.run_forever()
    finally:
        for env_id in list(host.envs):
            try:
                loop.run_until_complete(host.close([env_id]))
            except Exception:  # the process is ending either way
                pass
