"""The capacity planner as tables (scaleout.capacity_plan), and the run model that drives it
(bench/capacity_sim.py: simulated time only)."""

import sys
from pathlib import Path

import pytest

from scaleout.capacity_plan import PlannerSettings, QueueHealth, recommend

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from capacity_sim import Run, simulate  # noqa: E402


@pytest.mark.parametrize("health, split, reason", [
    # Trainers wait half the time while generation runs full: generation needs 2/3 of the devices.
    (QueueHealth(4, 4, gen_busy=1.0, trainer_busy=0.5), (5, 3), "balance busy time"),
    (QueueHealth(4, 4, gen_busy=0.5, trainer_busy=1.0), (3, 5), "balance busy time"),
    # Balanced within the dead band: nothing moves.
    (QueueHealth(4, 4, gen_busy=0.9, trainer_busy=0.85), (4, 4), "hold"),
    # Both full, with a sampling backlog: generation gets one more.
    (QueueHealth(4, 4, gen_busy=1.0, trainer_busy=1.0, sampling_queue_age_s=3.0), (5, 3), "sampling backlog"),
    # Both full, generation as far ahead as the staleness bound lets it: training gets one more.
    (QueueHealth(4, 4, gen_busy=1.0, trainer_busy=1.0, staleness_mean=2.0, staleness_bound=2),
     (3, 5), "generation ahead at the staleness bound"),
    # One side idle: no flow to read.
    (QueueHealth(4, 4, gen_busy=0.0, trainer_busy=1.0), (4, 4), "hold"),
    # Too few devices to move.
    (QueueHealth(1, 1, gen_busy=1.0, trainer_busy=0.1), (1, 1), "hold"),
])
def test_recommendations(health, split, reason):
    rec = recommend(health)
    assert (rec.gen_devices, rec.train_devices, rec.reason) == (*split, reason)


def test_moves_are_bounded_and_leave_each_side_a_device():
    rec = recommend(QueueHealth(500, 500, gen_busy=1.0, trainer_busy=0.01))
    assert rec.gen_devices == 750  # a quarter of the devices per call at most
    rec = recommend(QueueHealth(7, 1, gen_busy=1.0, trainer_busy=0.1), PlannerSettings(max_move=1.0))
    assert (rec.gen_devices, rec.train_devices) == (7, 1)  # already at the floor of 1 trainer


def test_planning_keeps_trainers_fed_as_rollouts_lengthen():
    r = Run(devices=64, horizon_s=3 * 3600.0)
    static, planned = simulate(r, planned=False), simulate(r, planned=True)
    assert static["trainer_waiting"] > 0.15  # the split balanced at the start is gen-starved at the end
    assert planned["trainer_waiting"] <= 0.10
    assert planned["staleness_max"] <= r.staleness and static["staleness_max"] <= r.staleness
    assert planned["final_gen"] > static["final_gen"]
