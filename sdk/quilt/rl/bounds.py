"""Bounds on an episode: a time limit on every call, a budget on every episode, and what each
breach does to the episode.

Every breach ends the episode with an outcome and a *cause*; the causes are counted per step
(:attr:`quilt.rl.StepLog.infra_causes`), so a run that loses episodes says to what.

========================  =======================  =================  ========================
breach                    cause                    outcome            retried
========================  =======================  =================  ========================
reset raised / timed out  ``reset_error`` /        infra_failure      yes: a new environment
                          ``reset_timeout``                           (``make_group(index, 1)``)
worker process lost       ``worker_lost``          infra_failure      at start, as a reset
step raised / timed out   ``step_error`` /         infra_failure      no (a step changes state)
                          ``step_timeout``
the env said so           ``env_reported``         infra_failure      no
reward raised / timed     ``reward_error`` /       infra_failure      yes (rewards are stateless)
out / answered badly      ``reward_timeout``
sampling failed (5xx,     ``sample_error``         infra_failure      yes (same prompt again)
connection)
sampling deadline         ``sample_deadline``      infra_failure      no (the pool is full)
``max_turns``             ``max_turns``            model_failure      -
``max_episode_tokens``    ``max_tokens``           model_failure      -
``max_episode_s``         ``wall_time``            ``wall_time_outcome`` (infra_failure) -
========================  =======================  =================  ========================

Infrastructure failures say nothing about the model, so their episodes are left out of training;
the turn and token budgets are the model's doing (it did not finish) and keep their reward. A wall
time breach is the platform's by default (slow sampling or slow tools), ``wall_time_outcome=
"model_failure"`` makes it the model's (an agent that dawdles).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from .env import OUTCOMES, Outcome

__all__ = ["CAUSES", "RETRIED", "EpisodeBudget", "WorkerLost", "bounded_call", "breach_outcome"]

#: Every cause an episode may end with other than finishing.
CAUSES: tuple[str, ...] = ("reset_error", "reset_timeout", "worker_lost", "step_error", "step_timeout",
                           "env_reported", "reward_error", "reward_timeout", "sample_error", "sample_deadline",
                           "max_turns", "max_tokens", "wall_time")

#: Causes whose call is tried again (up to ``max_infra_retries`` times) before the episode ends.
RETRIED: frozenset[str] = frozenset({"reset_error", "reset_timeout", "worker_lost", "reward_error", "reward_timeout",
                                     "sample_error"})

_MODEL_CAUSES = frozenset({"max_turns", "max_tokens"})


@dataclass(frozen=True)
class EpisodeBudget:
    """Limits on one episode: each environment call, the turns, the sampled tokens, the wall time.

    Attributes:
        step_timeout_s: time limit of each ``step`` call.
        reset_timeout_s: time limit of each start (``reset``, or a fork); None: ``step_timeout_s``.
        reward_timeout_s: time limit of each call of the run's reward function (one per group).
        max_turns: sampled turns per episode.
        max_episode_tokens: sampled tokens per episode (a turn is cut to what is left).
        max_episode_s: wall time from the episode's start to its last step's answer (None: no limit).
        wall_time_outcome: the outcome of a ``max_episode_s`` breach.
        max_infra_retries: how many times a retried call (see the table above) is tried again.
        sample_deadline_s: each sampling request is aborted by the pool if unfinished this long after
            submission (a congested pool, not the model's doing). None: the server's default.
    """

    step_timeout_s: float = 60.0
    max_turns: int = 1
    max_episode_tokens: int | None = None
    sample_deadline_s: float | None = None
    reset_timeout_s: float | None = None
    reward_timeout_s: float = 60.0
    max_episode_s: float | None = None
    wall_time_outcome: Outcome = "infra_failure"
    max_infra_retries: int = 2

    def __post_init__(self) -> None:
        for name in ("step_timeout_s", "reward_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("reset_timeout_s", "sample_deadline_s", "max_episode_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.max_episode_tokens is not None and self.max_episode_tokens < 1:
            raise ValueError(f"max_episode_tokens must be >= 1, got {self.max_episode_tokens}")
        if self.wall_time_outcome not in OUTCOMES or self.wall_time_outcome == "success":
            raise ValueError(f"wall_time_outcome must be a failure outcome of {OUTCOMES}, "
                             f"got {self.wall_time_outcome!r}")
        if not 0 <= self.max_infra_retries <= 10:
            raise ValueError(f"max_infra_retries must be within [0, 10], got {self.max_infra_retries}")

    @property
    def start_timeout_s(self) -> float:
        """The time limit of a start: ``reset_timeout_s``, or ``step_timeout_s`` when unset."""
        return self.reset_timeout_s if self.reset_timeout_s is not None else self.step_timeout_s


def breach_outcome(cause: str, budget: EpisodeBudget) -> Outcome:
    """The outcome an episode ending for ``cause`` gets (pure; the module's table)."""
    if cause not in CAUSES:
        raise ValueError(f"unknown cause {cause!r}")
    if cause in _MODEL_CAUSES:
        return "model_failure"
    if cause == "wall_time":
        return budget.wall_time_outcome
    return "infra_failure"


class WorkerLost(Exception):
    """The process or actor holding an environment died; its calls end as ``worker_lost``."""


async def bounded_call(awaitable, timeout_s: float, what: str) -> tuple[object, str | None, str | None]:
    """Await an environment's call within ``timeout_s``: ``(value, None, None)``, or ``(None, error,
    cause)`` when it timed out (``<what>_timeout``), raised (``<what>_error``) or its worker died
    (``worker_lost``). Never raises but for cancellation."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s), None, None
    except asyncio.TimeoutError:
        return None, f"{what} timed out after {timeout_s:g}s", f"{what}_timeout"
    except asyncio.CancelledError:
        raise
    except WorkerLost as exc:
        return None, f"{what}: {exc}", "worker_lost"
    except Exception as exc:  # an environment's own bug or its backend's failure: not the model's
        return None, f"{what} raised {type(exc).__name__}: {exc}", f"{what}_error"
