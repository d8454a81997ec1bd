"""tinker-cookbook environments (``tinker_cookbook.rl.types.Env``): token ids in and out already,
so nothing is decoded; ``initial_observation()`` is the reset, ``step(action)`` answers the
cookbook's ``StepResult`` (reward, ``episode_done``, next observation, metrics).

A cookbook ``EnvGroupBuilder`` makes a group's environments (``make_envs()``);
:func:`cookbook_group_builder` runs a list of them (or an ``RLDataset``'s batches) as quilt.rl
groups. Its ``compute_group_rewards`` (pairwise preference recipes) is not called: the step
rewards are the episode's. The stop condition the environment gives for each turn is the turn's
(an :class:`quilt.rl.Observation`), as the cookbook's own rollouts apply it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..env import Observation, StepResult
from ._text import ended, numeric

__all__ = ["CookbookEnv", "cookbook_group_builder"]


def _ints(observation: Any) -> list[int]:
    if hasattr(observation, "to_ints"):
        return [int(t) for t in observation.to_ints()]
    return [int(t) for t in observation]


def _stop(condition: Any) -> Any:
    # The cookbook's StopCondition: a list of strings or of token ids; empty means the model's own end.
    return list(condition) if condition else None


class CookbookEnv:
    """One episode of a tinker-cookbook ``Env`` as a :class:`quilt.rl.Env`."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.total = 0.0

    async def reset(self) -> Observation:
        """Start the episode; the first prompt's token ids."""
        first = await self.env.initial_observation()
        if not isinstance(first, tuple):  # InitialObservationOverflow: the prompt is past its budget
            raise ValueError(f"the cookbook environment's first prompt overflowed: {first!r}")
        observation, stop = first
        return Observation(_ints(observation), _stop(stop))

    async def step(self, tokens: list[int]) -> StepResult:
        """Hand the model's reply to the environment; its reward and what comes next."""
        result = await self.env.step(list(tokens))
        reward = float(result.reward)
        self.total += reward
        metrics = numeric(result.metrics)
        if result.episode_done:
            return StepResult(reward=reward, done=True, outcome=ended(self.total),
                              metrics=metrics)
        return StepResult(reward=reward, done=False, metrics=metrics,
                          next_prompt=Observation(_ints(result.next_observation), _stop(result.next_stop_condition)))


def cookbook_group_builder(builders: Sequence[Any] | Callable[[int], Any]):
    """``make_group(index, n)`` from cookbook ``EnvGroupBuilder``\\ s: ``builders[index % len]``,
    or ``builders(index)`` when a function (e.g. ``lambda i: dataset.get_batch(i // B)[i % B]``).
    The builder's ``make_envs()`` must make ``n`` environments."""
    if not callable(builders) and not builders:
        raise ValueError("cookbook_group_builder needs at least one EnvGroupBuilder")

    async def make_group(index: int, n: int) -> list[CookbookEnv]:
        builder = builders(index) if callable(builders) else builders[index % len(builders)]
        envs = list(await builder.make_envs())
        if n == 1 and len(envs) > 1:  # a replacement for one failed start: any member is the same task
            envs = envs[:1]
        if len(envs) != n:
            raise ValueError(f"the cookbook builder for group {index} made {len(envs)} envs; group_size is {n}")
        return [CookbookEnv(env) for env in envs]

    return make_group
