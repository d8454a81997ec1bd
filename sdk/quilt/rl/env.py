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

Starting is the expensive part of many environments (a sandbox to boot, a repository to clone), so
constructing an environment must be cheap and the start belongs in ``reset()``. An environment that
can copy itself implements :class:`Forkable`: a group then resets one environment and forks it
``n - 1`` times instead of starting ``n`` cold (see :mod:`quilt.rl.starts`).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from ..types import ModelInput

__all__ = ["OUTCOMES", "Env", "Forkable", "GroupBuilder", "Observation", "Outcome", "Prompt", "StepResult", "can_fork",
           "prompt_ids", "prompt_stop"]

Outcome = Literal["success", "model_failure", "infra_failure", "unknown"]

#: Every outcome a step may report. ``unknown`` episodes are trained on (their reward stands) but
#: counted apart, so a task that cannot grade most answers shows up in the logs.
OUTCOMES: tuple[str, ...] = ("success", "model_failure", "infra_failure", "unknown")

Prompt = Sequence[int] | ModelInput
#: Stop sequences of a turn: a string, strings, or token ids (as ``SamplingParams.stop``).
Stop = str | Sequence[str] | Sequence[int]


@dataclass(frozen=True)
class Observation:
    """A prompt with the stop condition of the turn it starts, for environments whose turns end on
    their own markers (a tool call's closing tag, a renderer's end of message). ``reset()`` and
    ``StepResult.next_prompt`` may answer one instead of a bare prompt; ``stop`` then replaces the
    run's ``sampling.stop`` for that turn (None keeps the run's)."""

    prompt: Prompt
    stop: Stop | None = None


def prompt_ids(prompt: Prompt | Observation) -> list[int]:
    """The token ids of a prompt (or an observation's prompt)."""
    if isinstance(prompt, Observation):
        prompt = prompt.prompt
    return prompt.to_ints() if isinstance(prompt, ModelInput) else [int(t) for t in prompt]


def prompt_stop(prompt: Prompt | Observation) -> str | tuple | None:
    """An observation's stop condition, hashable (a string or a tuple), or None."""
    stop = prompt.stop if isinstance(prompt, Observation) else None
    if stop is None or isinstance(stop, str):
        return stop
    stops = tuple(stop)
    if not (all(isinstance(s, str) for s in stops) or all(isinstance(s, int) and not isinstance(s, bool) for s in stops)):
        raise ValueError("a stop condition is a string, strings, or token ids")
    return stops


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
        info: anything a reward function needs besides the tokens (the reference answer, say);
            passed to :class:`quilt.rl.rewards.RewardFn` with the finished episode (the last step's
            keys win). Keep it picklable and JSON-friendly: it may cross to a remote grader.
    """

    reward: float
    done: bool = True
    outcome: Outcome = "success"
    next_prompt: Prompt | Observation | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    episode_hint: Literal["promote", "demote"] | None = None
    info: Mapping[str, Any] = field(default_factory=dict)

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

    async def reset(self) -> Prompt | Observation:
        """Start the episode; return the first prompt's token ids (or an :class:`Observation`)."""
        ...

    async def step(self, tokens: list[int]) -> StepResult:
        """Score the model's sampled ``tokens`` (stop token included when it stopped)."""
        ...


@runtime_checkable
class Forkable(Protocol):
    """An environment that can copy its state: ``snapshot()`` records it (after ``reset``),
    ``fork(snapshot)`` makes a new environment in that state, as if it had been reset too. A fork
    must cost much less than a cold start (a copy-on-write sandbox, a container checkpoint, a deep
    copy of a Python object) or there is nothing to gain."""

    async def snapshot(self) -> Any:
        """Record the current (just reset) state."""
        ...

    async def fork(self, snapshot: Any) -> Env:
        """A new environment in the state ``snapshot`` recorded."""
        ...


def can_fork(env: object) -> bool:
    """Whether ``env`` implements :class:`Forkable` (both methods callable)."""
    return callable(getattr(env, "snapshot", None)) and callable(getattr(env, "fork", None))


#: Makes the ``n`` environments of one GRPO group: the same task (same first prompt), ``n`` attempts.
#: Called as ``make_group(index, n)`` (the group's running index and its size); a plain function
#: or a coroutine function. Called again as ``make_group(index, 1)`` to replace an environment whose
#: start failed, so a builder should pick the task from ``index``, not at random. With a process or Ray
#: executor it runs on the workers: it must then be picklable (cloudpickle: closures are fine).
GroupBuilder = Callable[[int, int], Sequence[Env] | Awaitable[Sequence[Env]]]
