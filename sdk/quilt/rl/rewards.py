"""Rewards as calls: a group's finished episodes scored together, in process or remotely.

Many graders are stateless functions that do not belong in the environment: a unit-test runner,
a judge model, a verifier behind an HTTP endpoint. A run's ``reward`` (``RLConfig.reward``) is
called once per group, after its episodes end, with one :class:`RewardItem` per episode that
finished (infrastructure failures are not scored), and answers one value per item: a number (added
to the reward the environment's steps gave, usually 0) or ``{"reward": x, "outcome": "..."}`` to
also say how the episode ended. The call runs under the budget's ``reward_timeout_s`` and is retried
up to ``max_infra_retries`` times (rewards are stateless); what still fails ends the group's scored
episodes as ``infra_failure`` with cause ``reward_timeout`` or ``reward_error``.

Three kinds: :class:`LocalReward` (a function in this process), :class:`RayReward` (a Ray task per
group, on the cluster's CPU workers) and :class:`HTTPReward` (a POST per group).
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

from .env import OUTCOMES

__all__ = ["HTTPReward", "LocalReward", "RayReward", "RewardFn", "RewardItem", "Score", "parse_scores"]


@dataclass(frozen=True)
class RewardItem:
    """One finished episode as a grader sees it: token ids only, plus the environment's ``info``.

    Attributes:
        prompt: the episode's first prompt.
        turns: the tokens sampled on each turn.
        env_reward: the reward the environment's steps gave.
        info: the environment's ``StepResult.info`` (merged over its steps).
    """

    prompt: list[int]
    turns: list[list[int]]
    env_reward: float
    info: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict:
        """The item as plain JSON-friendly data (what a Ray task or an HTTP grader receives)."""
        return {**asdict(self), "info": dict(self.info)}


@dataclass(frozen=True)
class Score:
    """A grader's answer for one item."""

    reward: float
    outcome: str | None = None


@runtime_checkable
class RewardFn(Protocol):
    """Scores a group's finished episodes (see the module docstring)."""

    async def score(self, items: Sequence[RewardItem]) -> Sequence[Any]:
        """One number or ``{"reward": x, "outcome": "..."}`` per item, in order."""
        ...


def parse_scores(raw: Any, expected: int) -> list[Score]:
    """Check a grader's answer (pure): a list of ``expected`` finite numbers or reward/outcome
    objects. Raises ValueError naming what is wrong; the caller counts it as ``reward_error``."""
    if isinstance(raw, Mapping) and "rewards" in raw:
        raw = raw["rewards"]
    if not isinstance(raw, (list, tuple)):
        raise ValueError(f"a reward function must answer a list, got {type(raw).__name__}")
    if len(raw) != expected:
        raise ValueError(f"a reward function answered {len(raw)} rewards for {expected} episodes")
    scores = []
    for i, value in enumerate(raw):
        outcome = None
        if isinstance(value, Mapping):
            outcome = value.get("outcome")
            value = value.get("reward")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"reward {i} must be a finite number, got {value!r}")
        if outcome is not None and outcome not in OUTCOMES:
            raise ValueError(f"outcome {i} must be one of {OUTCOMES}, got {outcome!r}")
        scores.append(Score(float(value), outcome))
    return scores


class LocalReward:
    """A function in this process: ``fn(items) -> list`` (plain functions run in a thread, so a
    slow grader does not stall the other groups' sampling)."""

    def __init__(self, fn: Callable[[list[RewardItem]], Any]) -> None:
        self.fn = fn

    async def score(self, items: Sequence[RewardItem]) -> Sequence[Any]:
        """Call the function with the group's items."""
        if inspect.iscoroutinefunction(self.fn):
            return await self.fn(list(items))
        return await asyncio.to_thread(self.fn, list(items))


class RayReward:
    """A stateless function run as one Ray task per group on the cluster's workers.

    ``fn`` receives the items as plain dicts (:meth:`RewardItem.to_json`) and answers a list.
    ``options`` are the task's Ray options (``num_cpus``, ``resources``, ...). Ray must be
    initialised (``ray.init()``, or the executor's).
    """

    def __init__(self, fn: Callable[[list[dict]], Any], **options: Any) -> None:
        self.fn, self.options = fn, options
        self._task: Any = None  # the Ray remote function, made on first use (ray is imported then)

    async def score(self, items: Sequence[RewardItem]) -> Sequence[Any]:
        """Run the function as one Ray task for the group's items."""
        import ray

        if self._task is None:
            self._task = ray.remote(self.fn).options(**self.options) if self.options else ray.remote(self.fn)
        return await self._task.remote([item.to_json() for item in items])


class HTTPReward:
    """A grader behind an HTTP endpoint: ``POST url`` with ``{"items": [...]}`` (each item's
    ``to_json()``, plus ``"text"`` per turn when ``decode`` is given), answered by ``{"rewards":
    [...]}``. Non-2xx answers are ``reward_error``; the budget's ``reward_timeout_s`` bounds each call.
    """

    def __init__(self, url: str, *, headers: Mapping[str, str] | None = None,
                 decode: Callable[[list[int]], str] | None = None) -> None:
        self.url, self.headers, self.decode = url, dict(headers or {}), decode
        self._client: Any = None  # an httpx.AsyncClient, made on first use (httpx is imported then)
        # a client belongs to one event loop; train_grpo makes a new one per run
        self._loop: asyncio.AbstractEventLoop | None = None

    async def score(self, items: Sequence[RewardItem]) -> Sequence[Any]:
        """POST the group's items; the answer's rewards, unchecked (the rollout checks them)."""
        import httpx

        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._client, self._loop = httpx.AsyncClient(timeout=None, headers=self.headers), loop
        body = []
        for item in items:
            entry = item.to_json()
            if self.decode is not None:
                entry["text"] = [self.decode(turn) for turn in item.turns]
            body.append(entry)
        response = await self._client.post(self.url, json={"items": body})
        response.raise_for_status()
        return response.json()

    async def aclose(self) -> None:
        """Close the HTTP client (a run closes nothing it was given)."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None
