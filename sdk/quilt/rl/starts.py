"""Starting a group's environments: cold, forked from one reset, or taken warm from a pool.

A GRPO group is ``n`` attempts at one task, so its environments start from the same state. Cold,
each of the ``n`` runs ``reset()``: ``n`` sandbox boots on the critical path. When the environment
is :class:`~quilt.rl.env.Forkable`, :func:`start_group` resets one, snapshots it and forks the rest
(``n - 1`` cheap copies). Either way a :class:`WarmPool` keeps the next groups starting ahead of
demand, so a producer that asks for a group usually finds it ready and the start is off the
critical path; the pool's depth follows :func:`pool_target`, from the measured start time and
the rate at which groups are asked for.

A start whose reset fails is retried with a new environment (``make_group(index, 1)``) within the
budget's ``max_infra_retries``; what still fails reaches the rollout as an ``infra_failure`` member.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from .bounds import EpisodeBudget, bounded_call
from .env import Env, GroupBuilder, can_fork, prompt_ids, prompt_stop

__all__ = ["Started", "StartedGroup", "WarmPool", "close_env", "pool_target", "start_envs", "start_group"]

log = logging.getLogger("quilt.rl")


@dataclass
class Started:
    """One member of a started group: its environment and first prompt, or why it has none."""

    env: Env | None
    prompt: list[int] | None
    error: str | None = None
    cause: str | None = None
    stop: str | tuple | None = None  # the first turn's stop condition (quilt.rl.Observation)


@dataclass
class StartedGroup:
    """A group ready to roll out.

    ``start_s`` is the wall time the rollout waited for it (the whole start when started on
    demand; only the remainder when taken from a pool), ``cold`` and ``forks`` how its members were
    made, ``warm`` whether a pool had it ready, ``retries`` the start calls tried again per cause.
    """

    index: int
    members: list[Started]
    start_s: float = 0.0
    cold: int = 0
    forks: int = 0
    warm: bool = False
    retries: Counter = field(default_factory=Counter)
    # Frees the members' environments (remote ones live on a worker until closed).
    release: Callable[[], Awaitable[None]] | None = None


#: How long a ``close()`` may take before the rollout stops waiting for it (it is not the model's
#: business, and a group must never hang on an environment that will not close).
CLOSE_TIMEOUT_S = 30.0


async def close_env(env: object) -> None:
    """Call an environment's ``close()`` if it has one (a plain one in a thread), within
    :data:`CLOSE_TIMEOUT_S`; never raises."""
    close = getattr(env, "close", None)
    if not callable(close):
        return
    try:
        if inspect.iscoroutinefunction(close):
            await asyncio.wait_for(close(), CLOSE_TIMEOUT_S)
        else:
            await asyncio.wait_for(asyncio.to_thread(close), CLOSE_TIMEOUT_S)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a failing close must not fail the rollout that is already done
        log.warning("closing %s failed: %s", type(env).__name__, exc or type(exc).__name__)


async def build(builder: GroupBuilder, index: int, n: int) -> list[Env]:
    """``builder(index, n)``, awaited if it is a coroutine function, checked for ``n`` members."""
    envs = builder(index, n)
    if inspect.isawaitable(envs):
        envs = await envs
    envs = list(envs)
    if len(envs) != n:
        raise ValueError(f"make_group({index}, {n}) returned {len(envs)} envs")
    return envs


async def _reset(env: Env, builder: GroupBuilder | None, index: int, budget: EpisodeBudget,
                 retries: Counter) -> tuple[Started, int]:
    """Reset ``env``; on failure retry with a new one from ``builder`` (same index). Returns the
    member and the number of cold starts made."""
    colds = 0
    for attempt in range(budget.max_infra_retries + 1):
        colds += 1
        prompt, error, cause = await bounded_call(env.reset(), budget.start_timeout_s, "reset")
        if error is None:
            try:
                return Started(env, prompt_ids(prompt), stop=prompt_stop(prompt)), colds
            except (TypeError, ValueError) as exc:  # not token ids: the env's bug, as if it had raised
                error, cause = f"reset returned {type(prompt).__name__}, not token ids: {exc}", "reset_error"
        await close_env(env)
        if builder is None or attempt == budget.max_infra_retries:
            return Started(None, None, error, cause), colds
        log.info("group %d: %s; starting a new environment", index, error)
        retries[cause] += 1
        try:
            env = (await build(builder, index, 1))[0]
        except Exception as exc:
            error = f"make_group({index}, 1) raised {type(exc).__name__}: {exc}"
            return Started(None, None, error, "reset_error"), colds
    raise AssertionError("unreachable")


async def start_envs(envs: Sequence[Env], budget: EpisodeBudget, index: int = 0) -> StartedGroup:
    """Reset environments that were built already (``rollout_group`` given plain envs): cold, no retries."""
    started = time.monotonic()
    results = await asyncio.gather(*(_reset(env, None, index, budget, Counter()) for env in envs))
    return StartedGroup(index, [m for m, _ in results], start_s=time.monotonic() - started, cold=len(envs))


async def start_group(builder: GroupBuilder, index: int, n: int, budget: EpisodeBudget, *,
                      fork: bool = True) -> StartedGroup:
    """Build and start group ``index``: one reset and ``n - 1`` forks when the environment can fork
    (and ``fork``), else ``n`` resets. Runs where the environments live (in process, or on an
    executor's worker). Raises only for the builder's own errors (a user error: stop the run)."""
    began = time.monotonic()
    envs = await build(builder, index, n)
    retries: Counter = Counter()
    if not (fork and n > 1 and can_fork(envs[0])):
        results = await asyncio.gather(*(_reset(env, builder, index, budget, retries) for env in envs))
        return StartedGroup(index, [m for m, _ in results], start_s=time.monotonic() - began,
                            cold=sum(c for _, c in results), retries=retries)
    # Built cheap, never started: the forks take their places.
    await asyncio.gather(*(close_env(spare) for spare in envs[1:]))
    first, cold = await _reset(envs[0], builder, index, budget, retries)
    if first.env is None:
        members = [first] + [Started(None, None, first.error, first.cause) for _ in range(n - 1)]
        return StartedGroup(index, members, start_s=time.monotonic() - began, cold=cold, retries=retries)
    snapshot, error, cause = await bounded_call(first.env.snapshot(), budget.start_timeout_s, "reset")
    if error is not None:  # cannot fork after all: start the others cold
        log.info("group %d: snapshot failed (%s); starting the others cold", index, error)
        rest = await asyncio.gather(*(_reset(env, builder, index, budget, retries)
                                      for env in await build(builder, index, n - 1)))
        return StartedGroup(index, [first] + [m for m, _ in rest], start_s=time.monotonic() - began,
                            cold=cold + sum(c for _, c in rest), retries=retries)
    forks = await asyncio.gather(*(bounded_call(first.env.fork(snapshot), budget.start_timeout_s, "reset")
                                   for _ in range(n - 1)))
    members, made = [first], 0
    for env, error, cause in forks:
        if error is None:
            members.append(Started(env, list(first.prompt or ()), stop=first.stop))
            made += 1
            continue
        retries[cause] += 1  # a failed fork is replaced by a cold start
        replacement, c = await _reset((await build(builder, index, 1))[0], builder, index, budget, retries)
        cold += c
        members.append(replacement)
    return StartedGroup(index, members, start_s=time.monotonic() - began, cold=cold, forks=made, retries=retries)


def pool_target(*, start_s: float | None, groups_per_s: float | None, burst: int, cap: int,
                headroom: float = 1.5) -> int:
    """How many groups a warm pool keeps starting or ready (pure).

    Enough to cover the groups asked for while one start takes place (``start_s x groups_per_s``,
    with ``headroom`` for the tail), and never fewer than ``burst``, the groups a trainer asks for at
    once (a synchronous batch asks for all of its groups when the weights change). Before anything
    is measured, ``burst``. At most ``cap``.
    """
    if burst < 1 or cap < 1:
        raise ValueError(f"burst and cap must be >= 1, got {burst}, {cap}")
    need = burst
    if start_s is not None and groups_per_s is not None and start_s > 0 and groups_per_s > 0:
        need = max(need, math.ceil(start_s * groups_per_s * headroom))
    return min(cap, need)


class WarmPool:
    """Keeps the next groups starting ahead of demand; :meth:`take` hands them out in index order.

    ``start(index)`` starts one group (an executor's ``start_group`` with the run's builder).
    ``target`` is a fixed depth, or ``"auto"`` for :func:`pool_target` over the measured start
    time and the rate of :meth:`take`. Groups still starting count towards the depth. With
    ``limit``, no group from index ``limit`` on is started ahead (the groups a run can use; one
    taken past it still starts, on demand).
    """

    def __init__(self, start: Callable[[int], Awaitable[StartedGroup]], target: int | Literal["auto"], *,
                 burst: int, cap: int = 256, limit: int | None = None) -> None:
        if target != "auto" and (not isinstance(target, int) or target < 1):
            raise ValueError(f"warm pool target must be a positive integer or 'auto', got {target!r}")
        self._start, self._target, self._burst, self._cap = start, target, burst, cap
        # A group dropped at the staleness bound is replaced by one past `limit`: taken, it starts.
        self._limit = limit
        self._tasks: dict[int, asyncio.Task] = {}
        self._next = 0  # the next index to start
        self._start_s: float | None = None  # moving average of one group's start
        self._takes: deque[float] = deque(maxlen=max(4, 2 * burst))
        self.started = 0
        self.hits = 0  # groups that were ready when taken

    @property
    def target(self) -> int:
        """The depth the pool keeps now (fixed, or :func:`pool_target` over what it measured)."""
        if self._target != "auto":
            return min(self._target, self._cap)
        rate = None
        if len(self._takes) >= 2 and self._takes[-1] > self._takes[0]:
            rate = (len(self._takes) - 1) / (self._takes[-1] - self._takes[0])
        return pool_target(start_s=self._start_s, groups_per_s=rate, burst=self._burst, cap=self._cap)

    async def _timed(self, index: int) -> StartedGroup:
        began = time.monotonic()
        group = await self._start(index)
        took = time.monotonic() - began
        self._start_s = took if self._start_s is None else 0.8 * self._start_s + 0.2 * took
        return group

    def _fill(self, upto: int, ahead: bool = True) -> None:
        if ahead and self._limit is not None:
            upto = min(upto, self._limit)
        while self._next < upto:
            self._tasks[self._next] = asyncio.ensure_future(self._timed(self._next))
            self._next += 1
            self.started += 1

    async def take(self, index: int) -> StartedGroup:
        """Group ``index``, started ahead if the pool had it; the wait is its ``start_s``."""
        asked = time.monotonic()
        self._takes.append(asked)
        self._fill(max(self._next, index + 1), ahead=False)
        task = self._tasks.pop(index)
        ready = task.done()
        self._fill(index + 1 + self.target)
        group = await task
        group.warm = ready
        group.start_s = time.monotonic() - asked
        self.hits += ready
        return group

    async def aclose(self) -> None:
        """Stop starting and release the groups never taken."""
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                group = await task
            except BaseException:  # cancelled or failed while starting: nothing to release
                continue
            await release_group(group)


async def release_group(group: StartedGroup) -> None:
    """Free a group's environments (``close()`` them, or ask their worker to)."""
    if group.release is not None:
        try:
            await group.release()
        except Exception as exc:
            log.debug("releasing group %d failed: %s", group.index, exc)
        return
    await asyncio.gather(*(close_env(m.env) for m in group.members if m.env is not None))
