"""Gymnasium-style text environments: ``reset(seed=...) -> (observation, info)`` and
``step(action) -> (observation, reward, terminated, truncated, info)`` with strings for
observations and actions.

Each observation is a user message, each action the model's reply; the episode ends when the
environment terminates or truncates (a truncation is a ``model_failure``: it did not finish). The
group's environments are reset with the same seed (the group's index), so they start from one state.
Gymnasium environments are synchronous: their calls run in a thread, so a slow one does not stall
the event loop (a process or Ray executor also puts them on other cores). ``forkable=True`` forks
by ``copy.deepcopy`` of the environment (pure-Python environments; not one that holds a socket).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from typing import Any

from ..env import Outcome, StepResult
from ._lazy import PerProcess
from ._text import ChatCodec, ended, numeric

__all__ = ["GymnasiumTextEnv", "gymnasium_group_builder"]


class GymnasiumTextEnv:
    """One episode of a Gymnasium-style text environment as a :class:`quilt.rl.Env`."""

    def __init__(self, env: Any, codec: ChatCodec, *, seed: int | None = None, system: str | None = None,
                 forkable: bool = False) -> None:
        self.env, self.codec, self.seed, self.system = env, codec, seed, system
        self.messages: list[dict] = []
        self.total = 0.0
        if forkable:  # only then is it Forkable (quilt.rl.can_fork looks for these)
            self.snapshot, self.fork = self._snapshot, self._fork

    async def reset(self) -> list[int]:
        """Start the episode; the first prompt's token ids."""
        observation, _info = await asyncio.to_thread(self.env.reset, seed=self.seed)
        self.messages = ([{"role": "system", "content": self.system}] if self.system else [])
        self.messages.append({"role": "user", "content": _text(observation)})
        return self.codec.prompt(self.messages)

    async def step(self, tokens: list[int]) -> StepResult:
        """Hand the model's reply to the environment; its reward and what comes next."""
        action = self.codec.text(tokens)
        observation, reward, terminated, truncated, info = await asyncio.to_thread(self.env.step, action)
        reward = float(reward)
        self.total += reward
        self.messages += [{"role": "assistant", "content": action}, {"role": "user", "content": _text(observation)}]
        metrics = numeric(info)
        if terminated or truncated:
            outcome: Outcome = "model_failure" if truncated and not terminated else ended(self.total)
            return StepResult(reward=reward, done=True, outcome=outcome, metrics=metrics, info=metrics)
        return StepResult(reward=reward, done=False, next_prompt=self.codec.prompt(self.messages), metrics=metrics)

    async def _snapshot(self) -> Any:
        return copy.deepcopy((self.env, self.messages, self.total))

    async def _fork(self, snapshot: Any) -> GymnasiumTextEnv:
        env, messages, total = copy.deepcopy(snapshot)
        twin = GymnasiumTextEnv(env, self.codec, seed=self.seed, system=self.system, forkable=True)
        twin.messages, twin.total = messages, total
        return twin

    def close(self) -> None:
        """Close the wrapped environment."""
        self.env.close()


def _text(observation: Any) -> str:
    if isinstance(observation, str):
        return observation
    raise TypeError(f"a text environment's observation must be a string, got {type(observation).__name__}")


def gymnasium_group_builder(make_env: Callable[[int], Any], codec: Callable[[], ChatCodec], *,
                            system: str | None = None, forkable: bool = False):
    """``make_group(index, n)``: ``n`` of ``make_env(index)``, reset with seed ``index``.

    ``codec`` makes the :class:`ChatCodec` (once per process, where the environments run).
    """
    codecs = PerProcess(codec)

    def make_group(index: int, n: int) -> list[GymnasiumTextEnv]:
        return [GymnasiumTextEnv(make_env(index), codecs.get(), seed=index, system=system, forkable=forkable)
                for _ in range(n)]

    return make_group
