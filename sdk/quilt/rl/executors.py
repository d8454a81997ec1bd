"""Where environments run: in this process, in a local process pool, or on Ray actors.

One setting chooses (``RLConfig.executor``: ``"inprocess"``, ``"processes"``, ``"ray"``, or an
executor object for its options; ``QUILT_RL_EXECUTOR`` sets the default). Whatever the choice,
the group builder runs where the environments live, and only token ids, budgets and results cross:
the trainer's process never holds a sandbox, a dataset or a grader.

* :class:`InProcess`: today's way; every environment is a coroutine in the caller's event loop.
* :class:`ProcessPool`: ``workers`` local processes (``spawn``), each an event loop of its own, so
  environments that compute (a parser, a test run, a simulator) use more than one core and cannot
  stall sampling. A group's environments live on the least-loaded worker.
* :class:`RayActors`: ``actors`` Ray actors, on a Ray cluster (``address``, or KubeRay) or on a local
  ``ray.init()``: environment capacity scales apart from the GPUs.

A worker that dies (a segfault, the OOM killer, a lost node) fails its environments' calls as
``worker_lost`` (``infra_failure``: dropped from training, counted) and is replaced for the next
group; a start on a dead worker is retried on another. No call waits on a dead worker.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from .bounds import EpisodeBudget, WorkerLost
from .env import GroupBuilder, StepResult
from .starts import Started, StartedGroup, start_group

__all__ = ["EXECUTOR_ENV", "Executor", "InProcess", "ProcessPool", "RayActors", "make_executor"]

log = logging.getLogger("quilt.rl")

EXECUTOR_ENV = "QUILT_RL_EXECUTOR"


class Executor(Protocol):
    """Starts groups of environments somewhere; their members' ``env`` answer ``step`` from there."""

    async def start_group(self, builder: GroupBuilder, index: int, n: int, budget: EpisodeBudget, *,
                          fork: bool = True) -> StartedGroup:
        ...

    async def aclose(self) -> None:
        ...


class InProcess:
    """Environments as coroutines of the caller's event loop (the default)."""

    async def start_group(self, builder: GroupBuilder, index: int, n: int, budget: EpisodeBudget, *,
                          fork: bool = True) -> StartedGroup:
        """Start group ``index`` in this process (:func:`quilt.rl.start_group`)."""
        return await start_group(builder, index, n, budget, fork=fork)

    async def aclose(self) -> None:
        """Nothing to stop."""
        return None


class _RemoteEnv:
    """An environment on a worker, as the rollout sees it: ``step`` goes there."""

    def __init__(self, worker: Any, env_id: int) -> None:
        self.worker, self.env_id = worker, env_id

    async def reset(self):  # started on the worker already; a rollout never resets it again
        raise RuntimeError("a remote environment is reset on its worker by start_group")

    async def step(self, tokens: list[int]) -> StepResult:
        return await self.worker.call("step", self.env_id, [int(t) for t in tokens])


def _remote_group(worker: Any, index: int, answer: dict, release: Callable) -> StartedGroup:
    members = [Started(None if env_id is None else _RemoteEnv(worker, env_id), prompt, error, cause, stop)
               for env_id, prompt, error, cause, stop in answer["members"]]
    ids = [env_id for env_id, *_ in answer["members"] if env_id is not None]

    async def free() -> None:
        await release(worker, ids)

    return StartedGroup(index, members, start_s=answer["start_s"], cold=answer["cold"], forks=answer["forks"],
                        retries=Counter(answer["retries"]), release=free)


class EnvWorkerError(RuntimeError):
    """A worker's answer to a call that is not an environment's (the builder raised, say)."""


class _ProcessWorker:
    """One worker process and the calls waiting on it."""

    def __init__(self, context) -> None:
        from ._host import serve

        self.conn, child = context.Pipe(duplex=True)
        self.process = context.Process(target=serve, args=(child,), daemon=True, name="quilt-env-worker")
        self.process.start()
        child.close()
        self.loop = asyncio.get_running_loop()
        self.pending: dict[int, asyncio.Future] = {}
        self.registered: set[str] = set()
        self.envs = 0
        self.alive = True
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name="quilt-env-pipe", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                status, call_id, value = self.conn.recv()
            except (EOFError, OSError):
                self._post(self._lost)
                return
            self._post(self._answer, status, call_id, value)

    def _post(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the run's event loop has closed: nobody waits on this worker
            pass

    def _answer(self, status: str, call_id: int, value: Any) -> None:
        future = self.pending.pop(call_id, None)
        if future is None or future.done():
            return
        if status == "ok":
            future.set_result(value)
        else:
            future.set_exception(EnvWorkerError(value))

    def _lost(self) -> None:
        self.alive = False
        self.process.join(timeout=1)
        why = WorkerLost(f"environment worker {self.process.pid} exited (code {self.process.exitcode})")
        for future in self.pending.values():
            if not future.done():
                future.set_exception(why)
        self.pending.clear()

    @property
    def load(self) -> int:
        return self.envs + len(self.pending)

    def _send(self, message) -> None:
        with self._lock:
            self.conn.send(message)

    async def call(self, op: str, *args: Any) -> Any:
        if not self.alive:
            raise WorkerLost(f"environment worker {self.process.pid} is gone")
        call_id = next(self._ids)
        future = self.loop.create_future()
        self.pending[call_id] = future
        try:
            self._send((op, call_id, args))
        except (OSError, BrokenPipeError) as exc:
            self.pending.pop(call_id, None)
            raise WorkerLost(f"environment worker {self.process.pid}: {exc}") from exc
        try:
            return await future
        except asyncio.CancelledError:
            self.pending.pop(call_id, None)
            if self.alive:
                try:
                    self._send(("cancel", call_id, ()))
                except OSError:
                    pass
            raise

    def stop(self) -> None:
        # Asked, not closed: closing the pipe would not wake this side's reader thread, and the
        # worker would never see the end of it.
        if self.alive:
            try:
                self._send(("stop", 0, ()))
            except OSError:
                pass
        self.alive = False
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        try:
            self.conn.close()
        except OSError:
            pass


class _Workers:
    """What the process pool and the Ray executor share: slots of workers replaced when they die,
    builders registered once per worker, groups started on the least-loaded worker and released
    to it. Subclasses say how a worker is made (``_spawn``) and how a builder travels (``_payload``)."""

    def __init__(self, size: int) -> None:
        self._slots: list[Any] = [None] * size
        self._builders: dict[int, tuple[str, Any, GroupBuilder]] = {}
        self.replaced = 0

    def _spawn(self) -> Any:
        raise NotImplementedError

    def _payload(self, builder: GroupBuilder) -> Any:
        raise NotImplementedError

    def _pick(self) -> Any:
        for i, worker in enumerate(self._slots):
            if worker is None or not worker.alive:
                if worker is not None:
                    self.replaced += 1
                    log.warning("replacing environment worker %d", i)
                self._slots[i] = self._spawn()
        return min(self._slots, key=lambda w: w.load)

    async def _register(self, worker: Any, builder: GroupBuilder) -> str:
        entry = self._builders.get(id(builder))
        if entry is None or entry[2] is not builder:
            entry = (f"b{len(self._builders) + 1}", self._payload(builder), builder)
            self._builders[id(builder)] = entry
        key, payload, _ = entry
        if key not in worker.registered:
            await worker.call("register", key, payload)
            worker.registered.add(key)
        return key

    async def _release(self, worker: Any, ids: list[int]) -> None:
        worker.envs -= len(ids)
        if worker.alive and ids:
            try:
                await worker.call("close", ids)
            except (WorkerLost, EnvWorkerError):  # gone with its worker, or already closed
                pass

    async def start_group(self, builder: GroupBuilder, index: int, n: int, budget: EpisodeBudget, *,
                          fork: bool = True) -> StartedGroup:
        """Start group ``index`` on the least-loaded worker; a worker lost meanwhile is retried on another."""
        lost: Counter = Counter()
        for attempt in range(budget.max_infra_retries + 1):
            worker = self._pick()
            try:
                key = await self._register(worker, builder)
                answer = await worker.call("start_group", key, index, n, budget, fork)
            except WorkerLost as exc:
                if attempt == budget.max_infra_retries:
                    return StartedGroup(index, [Started(None, None, f"reset: {exc}", "worker_lost") for _ in range(n)],
                                        retries=lost)
                log.warning("group %d: %s; starting it on another worker", index, exc)
                lost["worker_lost"] += 1
                continue
            group = _remote_group(worker, index, answer, self._release)
            group.retries.update(lost)
            worker.envs += sum(m.env is not None for m in group.members)
            return group
        raise AssertionError("unreachable")


class ProcessPool(_Workers):
    """Environments in ``workers`` local processes (started on first use, replaced when they die).

    The builder is pickled once per worker (cloudpickle when installed, so closures work; the
    standard pickle otherwise, which needs an importable function).
    """

    def __init__(self, workers: int | None = None, *, start_method: str = "spawn") -> None:
        self.workers = workers or max(1, min(8, os.cpu_count() or 1))
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        super().__init__(self.workers)
        self._context = multiprocessing.get_context(start_method)

    def _spawn(self) -> _ProcessWorker:
        return _ProcessWorker(self._context)

    def _payload(self, builder: GroupBuilder) -> bytes:
        from ._host import dumps

        return dumps(builder)

    def _pick(self) -> _ProcessWorker:
        loop = asyncio.get_running_loop()
        for worker in self._slots:
            if worker is not None and worker.alive and worker.loop is not loop:
                # A pool used by another run (train_grpo makes a loop per run): its answers go here now;
                # calls of the old loop died with it.
                worker.loop, worker.pending = loop, {}
        return super()._pick()

    async def aclose(self) -> None:
        """Stop the worker processes (their environments are closed)."""
        for worker in self._slots:
            if worker is not None:
                await asyncio.to_thread(worker.stop)
        self._slots = [None] * self.workers


class _RayWorker:
    """One Ray actor, with the executor's bookkeeping."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.registered: set[str] = set()
        self.envs = 0
        self.inflight = 0
        self.alive = True

    @property
    def load(self) -> int:
        return self.envs + self.inflight

    async def call(self, op: str, *args: Any) -> Any:
        import ray.exceptions

        if not self.alive:
            raise WorkerLost("environment actor is gone")
        self.inflight += 1
        ref = getattr(self.actor, op).remote(*args)
        try:
            return await ref
        except ray.exceptions.RayActorError as exc:
            self.alive = False
            raise WorkerLost(f"environment actor died: {type(exc).__name__}") from exc
        except ray.exceptions.RayTaskError as exc:
            raise EnvWorkerError(str(exc.cause if exc.cause is not None else exc)) from exc
        except asyncio.CancelledError:
            ray.cancel(ref)
            raise
        finally:
            self.inflight -= 1


def _ray_host_class():
    import ray

    from ._host import EnvHost

    @ray.remote
    class QuiltEnvHost(EnvHost):
        """EnvHost as an async Ray actor (its methods run concurrently on the actor's event loop)."""

    return QuiltEnvHost


class RayActors(_Workers):
    """Environments on ``actors`` Ray actors.

    Connects to ``address`` (a Ray cluster, ``"auto"`` inside one) or starts a local Ray when none
    is running; ``actor_options`` are the actors' Ray options (``num_cpus``, ``resources``,
    ``runtime_env``, ...). A dead actor is replaced by a new one for the next group.
    """

    def __init__(self, actors: int = 4, *, address: str | None = None, actor_options: dict | None = None,
                 init_options: dict | None = None) -> None:
        if actors < 1:
            raise ValueError(f"actors must be >= 1, got {actors}")
        super().__init__(actors)
        self.actors, self.address = actors, address
        self.actor_options = {"num_cpus": 0.1, **(actor_options or {})}
        self.init_options = init_options or {}
        self._cls: Any = None

    def _spawn(self) -> _RayWorker:
        import ray

        if not ray.is_initialized():
            ray.init(address=self.address, include_dashboard=False, log_to_driver=False, **self.init_options)
        if self._cls is None:
            self._cls = _ray_host_class()
        return _RayWorker(self._cls.options(**self.actor_options).remote())

    def _payload(self, builder: GroupBuilder) -> Any:
        import ray

        return ray.put(builder)  # once in the object store, whatever the number of actors

    async def aclose(self) -> None:
        """Kill the actors (a Ray cluster started by ``ray.init`` keeps running)."""
        import ray

        for worker in self._slots:
            if worker is not None and worker.alive:
                ray.kill(worker.actor)
        self._slots = [None] * self.actors


def make_executor(setting: str | Executor | None) -> Executor:
    """The executor a setting names: an executor object as is; ``"inprocess"``, ``"processes"``
    or ``"ray"`` with their defaults; None reads ``QUILT_RL_EXECUTOR`` (default ``inprocess``)."""
    if setting is None:
        setting = os.environ.get(EXECUTOR_ENV, "inprocess")
    if not isinstance(setting, str):
        return setting
    name = setting.strip().lower()
    if name == "inprocess":
        return InProcess()
    if name == "processes":
        return ProcessPool()
    if name == "ray":
        return RayActors()
    raise ValueError(f"{EXECUTOR_ENV}/RLConfig.executor must be 'inprocess', 'processes' or 'ray', got {setting!r}")
