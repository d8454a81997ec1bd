"""Turning the capacity planner's split (scaleout.capacity_plan, in devices) into replica counts, and
the order of the moves that get there without losing a model or overrunning the devices: a pure
function over plain data, called by the scaler (stack.k8s_scaler) on each tick.

    step(rec, fleet, shards)   the counts to set now, the shards to drain or reopen first, and the
                               record the routers read (scaleout.in_service)

Rules, and why:
* a side's replicas are its devices over the devices each replica uses, kept within 1 and its
  named maximum (QUILT_GEN_REPLICAS / QUILT_TRAINER_SHARDS): workers past it have no stream;
* a trainer shard leaves only empty: the shards past the new count are drained first (their
  models move to the shards that stay, scaleout.placement) and the count drops on the tick that finds
  them holding nothing. Removing a shard that still held models would make them recover from
  snapshots elsewhere, a pause for their tenants that a drain avoids;
* a generation replica leaves at once: the record stops the routers sending it new groups in the
  same tick, and what it had queued moves to a live replica when its liveness lapses
  (gen_pool.router.reroute_dead_peers), so a client sees latency, not an error;
* the devices in use never exceed what the fleet uses now: a side grows only by what the other
  side has already given back, so a new pod never waits for an accelerator that is still held;
* a shard the scaler drained is reopened when the count takes it back; one an operator drained
  (`quilt trainers drain`) is left alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from core import queue
from scaleout.capacity_plan import Recommendation
from scaleout.in_service import InService
from scaleout.placement import ShardView


@dataclass(frozen=True)
class Fleet:
    """One base's workers as the cluster runs them now."""
    gen: int  # generation replicas running (the StatefulSet's replicas)
    trainer: int  # trainer shards running
    gen_max: int  # named replicas (QUILT_GEN_REPLICAS)
    trainer_max: int  # named shards (QUILT_TRAINER_SHARDS)
    devices_per_gen: int = 1
    devices_per_trainer: int = 1

    @property
    def devices(self) -> tuple[int, int]:
        return self.gen * self.devices_per_gen, self.trainer * self.devices_per_trainer


@dataclass(frozen=True)
class Step:
    gen: int  # replicas to set now
    trainer: int
    drain: tuple[str, ...]  # shards to mark draining before anything else
    reopen: tuple[str, ...]  # shards to undrain
    record: InService  # what the routers and health read from now on
    reason: str

    def changes(self, fleet: Fleet) -> bool:
        return (self.gen, self.trainer) != (fleet.gen, fleet.trainer) or bool(self.drain or self.reopen)


def _clamp(value: int, most: int) -> int:
    return min(max(value, 1), most)


def goal(rec: Recommendation, fleet: Fleet) -> tuple[int, int]:
    """The replica counts the recommendation asks for. Devices one side cannot take (past its named
    workers, or less than one of its pods) stay with the side that holds them."""
    if not rec.changes:
        return fleet.gen, fleet.trainer
    total = sum(fleet.devices)
    gen = _clamp(rec.gen_devices // fleet.devices_per_gen, fleet.gen_max)
    trainer = _clamp(rec.train_devices // fleet.devices_per_trainer, fleet.trainer_max)
    gen = max(gen, min(fleet.gen, (total - trainer * fleet.devices_per_trainer) // fleet.devices_per_gen))
    trainer = max(trainer, min(fleet.trainer, (total - gen * fleet.devices_per_gen) // fleet.devices_per_trainer))
    return gen, trainer


def step(rec: Recommendation, fleet: Fleet, shards: Mapping[str, ShardView], record: InService) -> Step:
    """The next move toward the recommendation (see the module docstring). `shards` holds the
    named shards' placement (scaleout.placement.read_views; absent: empty, open); `record` is what the
    scaler wrote last."""
    want_gen, want_trainer = goal(rec, fleet)
    names = queue.shard_names(fleet.trainer_max) if fleet.trainer_max > 1 else []
    total = sum(fleet.devices)
    drained = set(record.drained)
    drain: list[str] = []
    trainer, reason = fleet.trainer, rec.reason
    if want_trainer < fleet.trainer:
        leaving = names[want_trainer:fleet.trainer]
        drain = [s for s in leaving if not shards.get(s, ShardView(s)).draining]
        drained |= set(drain)  # not a shard an operator drained already: it stays theirs
        if not drain and all(shards.get(s, ShardView(s)).models == 0 for s in leaving):
            trainer = want_trainer
        else:
            reason = f"draining {', '.join(leaving)} before removing them"
    elif want_trainer > fleet.trainer:
        # Generation shrinks at once, so the trainers may grow into what it gives back this tick.
        room = (total - min(want_gen, fleet.gen) * fleet.devices_per_gen) // fleet.devices_per_trainer
        trainer = max(fleet.trainer, min(want_trainer, room))
    gen = max(1, min(want_gen, (total - trainer * fleet.devices_per_trainer) // fleet.devices_per_gen))
    if (gen < want_gen or trainer < want_trainer) and want_trainer >= fleet.trainer:
        reason = f"{reason}; waiting for devices the other side still holds"
    reopen = sorted(s for s in drained if s in names[:min(trainer, want_trainer)])
    drained -= set(reopen)
    return Step(gen=gen, trainer=trainer, drain=tuple(drain), reopen=tuple(reopen),
                record=InService(gen=gen, trainer=trainer, drained=tuple(sorted(drained))), reason=reason)
