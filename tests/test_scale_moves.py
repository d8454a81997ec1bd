"""The scaler's moves (scaleout.moves) as tables, and the record the routers read
(scaleout.in_service)."""

from __future__ import annotations

import pytest

from scaleout.capacity_plan import Recommendation
from scaleout.in_service import InService, dumps, parse
from scaleout.moves import Fleet, goal, step
from scaleout.placement import ShardView


def _rec(gen: int, train: int, reason: str = "balance busy time") -> Recommendation:
    return Recommendation(gen, train, float(gen), reason)


FLEET = Fleet(gen=2, trainer=2, gen_max=4, trainer_max=4)


@pytest.mark.parametrize(("rec", "fleet", "expected"), [
    (_rec(3, 1), FLEET, (3, 1)),
    (_rec(3, 1, "hold"), FLEET, (2, 2)),  # a hold keeps what runs, whatever the numbers
    # Generation can take one more (its named maximum): the trainers keep the rest.
    (_rec(7, 1), Fleet(gen=4, trainer=4, gen_max=5, trainer_max=4), (5, 3)),
    (_rec(6, 2), Fleet(gen=2, trainer=4, gen_max=8, trainer_max=4, devices_per_gen=2), (3, 2)),  # 2 devices each
    (_rec(1, 3), Fleet(gen=2, trainer=2, gen_max=4, trainer_max=2), (2, 2)),  # trainers full: nothing to free
    (_rec(0, 4), FLEET, (1, 4)),  # never below one (step keeps the sum within the devices)
])
def test_goal_is_devices_over_devices_per_replica_within_the_named_workers(rec, fleet, expected):
    assert goal(rec, fleet) == expected


def test_a_shard_is_drained_before_the_count_drops_and_generation_waits_for_its_device():
    first = step(_rec(3, 1), FLEET, {"shard-1": ShardView("shard-1", models=2)}, InService())
    assert (first.gen, first.trainer, first.drain) == (2, 2, ("shard-1",))
    assert first.reason == "draining shard-1 before removing them"
    assert first.record == InService(gen=2, trainer=2, drained=("shard-1",))
    # Drained but not yet empty: hold.
    second = step(_rec(3, 1), FLEET, {"shard-1": ShardView("shard-1", models=1, draining=True)}, first.record)
    assert (second.gen, second.trainer, second.drain) == (2, 2, ())
    # Empty: both move in one tick, generation into the device the shard gave back.
    third = step(_rec(3, 1), FLEET, {"shard-1": ShardView("shard-1", draining=True)}, second.record)
    assert (third.gen, third.trainer, third.drain, third.reopen) == (3, 1, (), ())
    assert third.record == InService(gen=3, trainer=1, drained=("shard-1",))
    assert third.changes(FLEET)


def test_taking_a_shard_back_reopens_only_what_the_scaler_drained():
    fleet = Fleet(gen=3, trainer=1, gen_max=4, trainer_max=4)
    operators = {"shard-2": ShardView("shard-2", draining=True)}  # drained by hand, for maintenance
    moved = step(_rec(1, 3), fleet, {"shard-1": ShardView("shard-1", draining=True), **operators},
                 InService(gen=3, trainer=1, drained=("shard-1",)))
    # Generation shrinks at once, so the trainers grow into its devices in the same tick.
    assert (moved.gen, moved.trainer, moved.reopen) == (1, 3, ("shard-1",))
    assert moved.record.drained == ()
    assert "shard-2" not in moved.reopen


def test_a_shard_an_operator_drained_stays_drained_after_the_scaler_removes_and_takes_it_back():
    fleet = Fleet(gen=1, trainer=2, gen_max=4, trainer_max=4)
    removed = step(_rec(2, 1), fleet, {"shard-1": ShardView("shard-1", draining=True)}, InService())
    assert (removed.gen, removed.trainer, removed.drain, removed.record.drained) == (2, 1, (), ())
    back = step(_rec(1, 2), Fleet(gen=2, trainer=1, gen_max=4, trainer_max=4),
                {"shard-1": ShardView("shard-1", draining=True)}, removed.record)
    assert (back.gen, back.trainer, back.reopen) == (1, 2, ())


def test_generation_shrinks_at_once_and_a_hold_changes_nothing():
    moved = step(_rec(1, 3), FLEET, {}, InService())
    assert (moved.gen, moved.trainer, moved.drain) == (1, 3, ())
    held = step(_rec(2, 2, "hold"), FLEET, {}, InService(gen=2, trainer=2))
    assert not held.changes(FLEET) and held.reason == "hold"


def test_a_side_grows_only_into_devices_already_given_back():
    over = step(_rec(0, 4), FLEET, {}, InService())
    assert (over.gen, over.trainer) == (1, 3)
    # Two devices per generation pod: one trainer device is not enough for another, so the trainer
    # keeps it and nothing is drained.
    fleet = Fleet(gen=1, trainer=3, gen_max=4, trainer_max=4, devices_per_gen=2)
    moved = step(_rec(3, 2), fleet, {"shard-2": ShardView("shard-2", models=1)}, InService())
    assert (moved.gen, moved.trainer, moved.drain) == (1, 3, ())


def test_one_trainer_without_shards_is_never_drained():
    fleet = Fleet(gen=1, trainer=1, gen_max=4, trainer_max=1)
    moved = step(_rec(2, 1), fleet, {}, InService())
    assert (moved.gen, moved.trainer, moved.drain) == (1, 1, ())
    assert "waiting for devices" in moved.reason


@pytest.mark.parametrize("raw", [None, b"", b"not json", b"[1, 2]", b'{"gen": "x"}', b'{"gen": {}}'])
def test_an_unreadable_record_means_every_worker_serves(raw):
    assert parse(raw) == InService()


def test_the_record_round_trips_and_trims_names():
    record = InService(gen=1, trainer=2, drained=("shard-2",), reason="r", at=5.0)
    assert parse(dumps(record)) == record
    assert record.gen_names(["gen-0", "gen-1"]) == ["gen-0"]
    assert record.trainer_names(["shard-0", "shard-1", "shard-2"]) == ["shard-0", "shard-1"]
    assert InService().gen_names(["gen-0", "gen-1"]) == ["gen-0", "gen-1"]
    assert InService(gen=0).gen_names(["gen-0", "gen-1"]) == ["gen-0"]
