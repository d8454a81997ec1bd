"""How to split accelerators between generation replicas and trainer shards: a pure function of
queue health, asked periodically.

RL post-training is a pipeline: generators make rollouts, trainers consume them. Whichever side
is slower sets the pace and the other waits, and the balance moves during a run (responses
lengthen as a policy learns: generation per batch grows with the length, training per batch less
than proportionally, since prompts do not grow). A split chosen at the start drifts out of balance.

`recommend` reads what the pool already measures (`QueueHealth`: how busy each side was over the
window, the age of the oldest queued sampling request, the staleness of trained data against its
bound, and for the page each side's token rate) and answers the split that would balance the two
sides (`Recommendation`), moving at most `max_move` of the devices per call and only past a dead
band, so a noisy reading does not make replicas flap:

* the device-seconds per second each side actually needed: G = generation devices x their busy
  fraction, T = trainer devices x theirs. Both moved the same rollouts, so giving each side devices
  in proportion (generation = total x G / (G + T)) lets both run full: no unit conversion between
  generated and trained tokens is needed;
* a backlog (sampling requests waiting while generation runs full) says generation needed more
  than it had: it leans one step to generation; staleness at its bound while trainers run full
  says generation ran as far ahead as it may: one step to training;
* neither side goes below `min_each`.

No I/O and no clock: the operator page shows its answer, bench/capacity_sim.py drives it with a
model of a run whose rollouts triple in length, and a deployment may act on it (off by default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class QueueHealth:
    gen_devices: int
    train_devices: int
    gen_busy: float  # fraction of generation slot capacity in use over the window (0..1)
    trainer_busy: float  # fraction of trainer time computing (1 - waiting)
    sampling_queue_age_s: float = 0.0  # oldest sampling request not yet started
    staleness_mean: float = 0.0
    staleness_bound: float = 0.0  # max_staleness of the runs; 0 = on-policy
    generated_tokens_per_s: float = 0.0  # shown beside the answer, not used by it
    trained_tokens_per_s: float = 0.0


@dataclass(frozen=True)
class Recommendation:
    gen_devices: int
    train_devices: int
    balanced_gen_devices: float  # the unrounded, unclamped balance point
    reason: str

    @property
    def changes(self) -> bool:
        return self.reason != "hold"


@dataclass(frozen=True)
class PlannerSettings:
    min_each: int = 1
    max_move: float = 0.25  # fraction of all devices moved in one call at most
    dead_band: float = 0.05  # ignore a balance point closer than this fraction of all devices
    busy_floor: float = 0.05  # device-seconds per second below which a side counts as idle


def recommend(h: QueueHealth, s: PlannerSettings = PlannerSettings()) -> Recommendation:  # noqa: B008
    """The split to move toward now (see the module docstring)."""
    total = h.gen_devices + h.train_devices
    hold = Recommendation(h.gen_devices, h.train_devices, float(h.gen_devices), "hold")
    used_gen, used_train = h.gen_devices * min(h.gen_busy, 1.0), h.train_devices * min(h.trainer_busy, 1.0)
    if total < 2 * s.min_each or used_gen < s.busy_floor or used_train < s.busy_floor:
        return hold  # one side idle: nothing flows, no balance to read
    balanced = total * used_gen / (used_gen + used_train)
    reason = "balance busy time"
    if h.sampling_queue_age_s > 0 and h.gen_busy >= 0.95 and balanced <= h.gen_devices:
        balanced, reason = h.gen_devices + 1, "sampling backlog"
    at_bound = h.staleness_bound > 0 and h.staleness_mean >= h.staleness_bound - 0.25
    if at_bound and h.trainer_busy >= 0.95 and balanced >= h.gen_devices:
        balanced, reason = h.gen_devices - 1, "generation ahead at the staleness bound"
    if abs(balanced - h.gen_devices) < max(s.dead_band * total, 0.5):
        return Recommendation(h.gen_devices, h.train_devices, balanced, "hold")
    step = max(1, math.floor(s.max_move * total))
    gen = min(max(round(balanced), h.gen_devices - step), h.gen_devices + step)
    gen = min(max(gen, s.min_each), total - s.min_each)
    if gen == h.gen_devices:
        return Recommendation(gen, total - gen, balanced, "hold")
    return Recommendation(gen, total - gen, balanced, reason)
