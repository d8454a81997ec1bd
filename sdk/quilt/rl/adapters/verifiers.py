"""verifiers environments (Prime's Environments Hub): the environment's own turn logic
(``setup_state``, ``env_response``, its stop conditions) and its rubric's reward functions, with
Quilt sampling the model's turns instead of an OpenAI client.

A verifiers environment normally drives the model itself through an OpenAI client
(``env.rollout(input, client, model)``); here each of the model's replies arrives as sampled tokens,
is decoded into an assistant message and recorded as a trajectory step the way verifiers records
one, and the environment's stop conditions decide whether the episode goes on. When it ends, the
rubric scores the rollout (``rubric.score_rollout``: the environment's reward functions and weights).
Rubrics with group-level reward functions are refused (they need every rollout of the group at
once; score them through ``RLConfig.reward``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from ..env import Outcome, StepResult
from ._lazy import PerProcess
from ._text import ChatCodec, numeric

__all__ = ["VerifiersEnv", "verifiers_group_builder"]


class VerifiersEnv:
    """One rollout of a verifiers environment, on dataset row ``row``, as a :class:`quilt.rl.Env`."""

    def __init__(self, vf_env: Any, row: Mapping[str, Any], codec: ChatCodec) -> None:
        if getattr(vf_env.rubric, "_get_group_reward_funcs", list)():
            raise ValueError("this verifiers rubric has group-level reward functions; VerifiersEnv scores each "
                             "rollout alone (pass the group reward as RLConfig.reward)")
        self.vf_env, self.row, self.codec = vf_env, dict(row), codec
        self.state: Any = None
        self.prompt_messages: list = []

    async def reset(self) -> list[int]:
        """Start the episode; the first prompt's token ids."""
        from verifiers.types import RolloutInput

        fields = {k: self.row[k] for k in ("prompt", "example_id", "task", "answer", "info") if k in self.row}
        fields.setdefault("example_id", 0)
        state = await self.vf_env.init_state(RolloutInput(**fields), client=None, model="quilt")
        self.state = await self.vf_env.setup_state(state)
        return await self._next_prompt()

    async def _next_prompt(self) -> list[int]:
        self.prompt_messages = await self.vf_env.get_prompt_messages(self.state)
        return self.codec.prompt(self.prompt_messages)

    async def step(self, tokens: list[int]) -> StepResult:
        """Hand the model's reply to the environment; its reward and what comes next."""
        from verifiers.types import TrajectoryStep

        text = self.codec.text(tokens)
        await self.vf_env.add_trajectory_step(self.state, TrajectoryStep(
            prompt=self.prompt_messages, completion=[{"role": "assistant", "content": text}], response=None,
            tokens=None, reward=None, advantage=None, is_truncated=False,
            trajectory_id=self.state["trajectory_id"], extras={}))
        if not await self.vf_env.is_completed(self.state):
            prompt = await self._next_prompt()
            if self.state.get("final_env_response") is None:
                return StepResult(reward=0.0, done=False, next_prompt=prompt)
            await self.vf_env.is_completed(self.state)  # the environment said its last word
        await self.vf_env.render_completion(self.state)
        if self.state.get("error") is not None:
            return StepResult(reward=0.0, outcome="infra_failure", metrics={"vf_error": 1.0})
        await self.vf_env.rubric.score_rollout(self.state, score_sem=asyncio.Semaphore(1))
        reward = float(self.state["reward"] or 0.0)
        outcome: Outcome = "model_failure" if self.state.get("is_truncated") or reward <= 0 else "success"
        return StepResult(reward=reward, outcome=outcome, metrics=numeric(self.state.get("metrics")))


def verifiers_group_builder(load: Callable[[], Any], codec: Callable[[], ChatCodec]):
    """``make_group(index, n)``: ``n`` rollouts of dataset row ``index % len(dataset)``.

    ``load`` makes the verifiers environment (``lambda: vf.load_environment("name")``) once per
    process, where the environments run; ``codec`` makes the :class:`ChatCodec`.
    """
    envs = PerProcess(load)
    codecs = PerProcess(codec)
    rows = PerProcess(lambda: envs.get().get_dataset())

    def make_group(index: int, n: int) -> list[VerifiersEnv]:
        dataset = rows.get()
        row = dataset[index % len(dataset)]
        return [VerifiersEnv(envs.get(), row, codecs.get()) for _ in range(n)]

    return make_group
