"""OpenEnv environments: an ``openenv.core.env_server.Environment`` in this process (or a
worker's), or an ``EnvClient`` talking to one served elsewhere (a container, a Space).

OpenEnv actions and observations are typed per environment, so the adapter takes two functions:
``action(text) -> Action`` (the model's reply as the environment's action) and ``render(observation)
-> str`` (what the model reads next). The observation's own ``reward`` and ``done`` (the
environment's rubric) are the episode's.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ..env import StepResult
from ._lazy import PerProcess
from ._text import ChatCodec, ended, numeric

__all__ = ["OpenEnvEnv", "openenv_group_builder"]


class OpenEnvEnv:
    """One episode of an OpenEnv environment (or client) as a :class:`quilt.rl.Env`."""

    def __init__(self, env: Any, codec: ChatCodec, *, action: Callable[[str], Any], render: Callable[[Any], str],
                 seed: int | None = None, system: str | None = None) -> None:
        self.env, self.codec, self.action, self.render = env, codec, action, render
        self.seed, self.system = seed, system
        self.messages: list[dict] = []
        self.total = 0.0

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> tuple[Any, float, bool]:
        # A server-side Environment has reset_async/step_async returning the observation; a client's
        # reset/step are coroutines returning a StepResult(observation, reward, done).
        local = getattr(self.env, f"{method}_async", None)
        if local is not None:
            obs = await local(*args, **kwargs)
            return obs, float(obs.reward or 0.0), bool(obs.done)
        result = getattr(self.env, method)(*args, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result.observation, float(result.reward or 0.0), bool(result.done)

    async def reset(self) -> list[int]:
        """Start the episode; the first prompt's token ids."""
        obs, _, _ = await self._call("reset", seed=self.seed)
        self.messages = ([{"role": "system", "content": self.system}] if self.system else [])
        self.messages.append({"role": "user", "content": self.render(obs)})
        return self.codec.prompt(self.messages)

    async def step(self, tokens: list[int]) -> StepResult:
        """Hand the model's reply to the environment; its reward and what comes next."""
        text = self.codec.text(tokens)
        obs, reward, done = await self._call("step", self.action(text))
        self.total += reward
        metrics = numeric(getattr(obs, "metadata", None))
        if done:
            return StepResult(reward=reward, done=True, outcome=ended(self.total),
                              metrics=metrics)
        self.messages += [{"role": "assistant", "content": text}, {"role": "user", "content": self.render(obs)}]
        return StepResult(reward=reward, done=False, next_prompt=self.codec.prompt(self.messages), metrics=metrics)

    async def close(self) -> None:
        """Close the wrapped environment or client."""
        close = getattr(self.env, "close", None)
        if close is not None:
            result = close()
            if inspect.isawaitable(result):
                await result


def openenv_group_builder(make_env: Callable[[int], Any], codec: Callable[[], ChatCodec], *,
                          action: Callable[[str], Any], render: Callable[[Any], str], system: str | None = None):
    """``make_group(index, n)``: ``n`` of ``make_env(index)`` (an Environment or an EnvClient),
    reset with seed ``index``."""
    codecs = PerProcess(codec)

    def make_group(index: int, n: int) -> list[OpenEnvEnv]:
        return [OpenEnvEnv(make_env(index), codecs.get(), action=action, render=render, seed=index, system=system)
                for _ in range(n)]

    return make_group
