"""SkyRL-Gym text environments (``skyrl_gym.envs.base_text_env.BaseTextEnv``): ``init(prompt)``
gives the first conversation, ``step(action)`` answers observations (messages), a reward and
``done``. Their own reward code (``_get_reward``, the reward spec of the dataset row) scores.

A row is a SkyRL dataset row: ``prompt`` (messages), ``env_class`` (a registered SkyRL-Gym id,
such as ``"gsm8k"``), and whatever the environment reads from its ``extras`` (``reward_spec``,
``extra_info``). Calls run in a thread (SkyRL-Gym environments are synchronous).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..env import StepResult
from ._lazy import PerProcess
from ._text import ChatCodec, ended, numeric

__all__ = ["SkyRLGymEnv", "skyrl_group_builder"]


class SkyRLGymEnv:
    """One episode of a SkyRL-Gym ``BaseTextEnv`` as a :class:`quilt.rl.Env`."""

    def __init__(self, env: Any, prompt: Sequence[Mapping[str, Any]], codec: ChatCodec) -> None:
        self.env, self.prompt, self.codec = env, [dict(m) for m in prompt], codec
        self.messages: list[dict] = []
        self.total = 0.0

    async def reset(self) -> list[int]:
        """Start the episode; the first prompt's token ids."""
        messages, _metadata = await asyncio.to_thread(self.env.init, [dict(m) for m in self.prompt])
        self.messages = [dict(m) for m in messages]
        return self.codec.prompt(self.messages)

    async def step(self, tokens: list[int]) -> StepResult:
        """Hand the model's reply to the environment; its reward and what comes next."""
        action = self.codec.text(tokens)
        out = await asyncio.to_thread(self.env.step, action)
        reward = float(out["reward"])
        self.total += reward
        said = out.get("postprocessed_action") or action
        self.messages += [{"role": "assistant", "content": said}, *[dict(m) for m in out.get("observations") or []]]
        metrics = numeric(out.get("metadata"))
        if out["done"]:
            metrics.update(numeric(self.env.get_metrics()))
            return StepResult(reward=reward, done=True, outcome=ended(self.total),
                              metrics=metrics)
        return StepResult(reward=reward, done=False, next_prompt=self.codec.prompt(self.messages), metrics=metrics)

    def close(self) -> None:
        """Close the wrapped environment."""
        self.env.close()


def skyrl_group_builder(rows: Sequence[Mapping[str, Any]], codec: Callable[[], ChatCodec], *,
                        env_class: str | Callable[..., Any] | None = None, env_config: Any = None):
    """``make_group(index, n)``: ``n`` environments of row ``index % len(rows)``.

    Each is ``skyrl_gym.make(row["env_class"] or env_class, env_config=env_config, extras=row)``,
    or ``env_class(env_config=env_config, extras=row)`` when ``env_class`` is a class or function.
    """
    if not rows:
        raise ValueError("skyrl_group_builder needs at least one row")
    codecs = PerProcess(codec)

    def make_env(row: Mapping[str, Any]) -> Any:
        kind = row.get("env_class") or env_class
        if kind is None:
            raise ValueError("the row has no env_class and no env_class was given")
        if isinstance(kind, str):
            import skyrl_gym

            return skyrl_gym.make(kind, env_config=env_config, extras=dict(row))
        return kind(env_config=env_config, extras=dict(row))

    def make_group(index: int, n: int) -> list[SkyRLGymEnv]:
        row = rows[index % len(rows)]
        return [SkyRLGymEnv(make_env(row), row["prompt"], codecs.get()) for _ in range(n)]

    return make_group
