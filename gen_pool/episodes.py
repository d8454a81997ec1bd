"""Feedback levels for multi-turn episodes: demote by tokens consumed, not by predicted length.

An agentic episode is a chain of sampling calls (model turn, tool call, model turn, ...) whose
length nobody knows in advance. Admission (rule 6 of gen_pool.admission) serves lower levels
first; this module says which level an episode's next call is on, from what it has consumed so
far (least attained service, as a multi-level feedback queue approximates it):

* level 0 until the episode has consumed `quantum_tokens` generated tokens, level 1 until
  `growth` times that more, and so on, up to `levels - 1`: short episodes finish ahead of the
  long tail, with no length prediction.
* aging: a call that has waited `aging_s` rises one level per `aging_s` waited, so a long
  episode is delayed, never starved.
* the client's hint, sent with a call: `promote` (say the tool returned what ends the episode)
  moves the episode one level up for good, `demote` (say a retry loop began) one level down.

`level` is a pure function; `EpisodeLedger` is the bookkeeping (bounded, oldest forgotten first)
the scheduler and bench/genpool_episodes.py keep. Episodes are per tenant: two tenants' ids never
meet.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

Hint = Literal["promote", "demote"]
HINTS: tuple[str, ...] = ("promote", "demote")


@dataclass(frozen=True)
class FeedbackLevels:
    quantum_tokens: int = 256  # generated tokens an episode consumes on level 0
    growth: int = 4  # each level holds this many times the tokens of the one before
    levels: int = 4  # 1 = feedback levels off (every episode on level 0)
    aging_s: float = 10.0  # waiting this long raises a call one level; 0 = no aging


def level(consumed: int, shift: int, waited_s: float, cfg: FeedbackLevels) -> int:
    """The level of an episode's waiting call: by tokens consumed, moved by hints, raised by waiting."""
    top = cfg.levels - 1
    lvl, bound = 0, cfg.quantum_tokens
    while lvl < top and consumed >= bound:
        lvl += 1
        bound *= cfg.growth
    lvl += shift
    if cfg.aging_s > 0:
        lvl -= int(max(waited_s, 0.0) // cfg.aging_s)
    return min(max(lvl, 0), top)


@dataclass
class _Episode:
    consumed: int = 0
    shift: int = 0


class EpisodeLedger:
    """Tokens consumed and hint shifts per (tenant, episode id), the `capacity` most recent kept."""

    def __init__(self, cfg: FeedbackLevels, capacity: int = 65_536) -> None:
        self.cfg, self.capacity = cfg, capacity
        self._episodes: OrderedDict[tuple[str, str], _Episode] = OrderedDict()

    def _get(self, tenant: str, episode: str) -> _Episode:
        key = (tenant, episode)
        e = self._episodes.get(key)
        if e is None:
            e = self._episodes[key] = _Episode()
            while len(self._episodes) > self.capacity:
                self._episodes.popitem(last=False)
        else:
            self._episodes.move_to_end(key)
        return e

    def hint(self, tenant: str, episode: str, hint: Hint | None) -> None:
        """A call of the episode arrived, with the client's hint if any."""
        e = self._get(tenant, episode)
        if hint == "promote":
            e.shift = max(e.shift - 1, -(self.cfg.levels - 1))
        elif hint == "demote":
            e.shift = min(e.shift + 1, self.cfg.levels - 1)

    def consume(self, tenant: str, episode: str, tokens: int) -> None:
        self._get(tenant, episode).consumed += tokens

    def level(self, tenant: str, episode: str | None, waited_s: float) -> int:
        if episode is None:
            return 0
        e = self._episodes.get((tenant, episode))
        return 0 if e is None else level(e.consumed, e.shift, waited_s, self.cfg)

    def __len__(self) -> int:
        return len(self._episodes)


def levels_of(settings) -> FeedbackLevels:
    """The feedback levels a generation worker's settings (core.settings.GenPoolSettings) ask for."""
    return FeedbackLevels(quantum_tokens=settings.episode_quantum_tokens, levels=settings.episode_levels,
                          aging_s=settings.episode_aging_s)
