"""The environment protocol: what an RL task looks like to Quilt's rollout helpers.

An environment is one episode of a task. ``reset()`` gives the first prompt (token ids); each
``step(tokens)`` takes what the model sampled and answers with a reward, whether the episode is over
and, for multi-turn tasks, the next prompt (the whole context the model reads next). Both are
coroutines, so an environment may call a sandbox, a grader or a web service without blocking the
others.

Every step also says how it ended, as an :data:`Outcome`. The distinction matters for training: a
``model_failure`` (wrong answer, bad format, ran out of budget) is a real, low reward to learn from,
while an ``infra_failure`` (a grader that crashed, a tool that timed out) says nothing about the
model and must not push its policy around, so those episodes are left out of training and counted.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, Union, runtime_checkable

from ..types import ModelInput

__all__ = ["OUTCOMES", "Env", "GroupBuilder", "Outcome", "Prompt", "StepResult"]

Outcome = Literal["success", "model_failure", "infra_failure", "unknown"]

#: Every outcome a step may report. ``unknown`` episodes are trained on (their reward stands) but
#: counted apart, so a task that cannot grade most answers shows up in the logs.
OUTCOMES: tuple[str, ...] = ("success", "model_failure", "infra_failure", "unknown")

Prompt = Union[Sequence[int], ModelInput]


@dataclass(frozen=True)
class StepResult:
    """What an environment answers to one ``step``.

    Attributes:
        reward: this step's reward; an episode's reward is the sum over its steps.
        done: the episode is over (single-turn tasks always answer True).
        outcome: how the step ended, one of :data:`OUTCOMES`.
        next_prompt: multi-turn only: the full context the model reads on the next turn.
        metrics: numbers to average into the step log (``name -> value``).
        episode_hint: multi-turn only, optional: ``"promote"`` when the next turn likely ends the
            episode (say the tool returned the answer), ``"demote"`` when it likely starts a long
            detour (say a retry loop); the pool moves the episode one priority level accordingly.
    """

    reward: float
    done: bool = True
    outcome: Outcome = "success"
    next_prompt: Prompt | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    episode_hint: Literal["promote", "demote"] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward):
            raise ValueError(f"StepResult.reward must be a finite number, got {self.reward!r}")
        if self.outcome not in OUTCOMES:
            raise ValueError(f"StepResult.outcome must be one of {OUTCOMES}, got {self.outcome!r}")
        if self.episode_hint not in (None, "promote", "demote"):
            raise ValueError(f"StepResult.episode_hint must be 'promote', 'demote' or None, got {self.episode_hint!r}")
        if not self.done and self.next_prompt is None:
            raise ValueError("StepResult.next_prompt is required when done is False (the model needs a next turn)")


@runtime_checkable
class Env(Protocol):
    """One episode of a task (see the module docstring)."""

    async def reset(self) -> Prompt:
        """Start the episode; return the first prompt's token ids."""
        ...

    async def step(self, tokens: list[int]) -> StepResult:
        """Score the model's sampled ``tokens`` (stop token included when it stopped)."""
        ...


#: Makes the ``n`` environments of one GRPO group: the same task (same first prompt), ``n`` attempts.
#: Called as ``make_group(index, n)`` (the group's running index and its size); a plain function
#: or a coroutine function.
GroupBuilder = Callable[[int, int], Union[Sequence[Env], Awaitable[Sequence[Env]]]]
