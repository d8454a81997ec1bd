"""The simulator behind bench/genpool_sim.py and bench/genpool_sweep.py: its accounting holds and it
drives the real admission policy (no timing: simulated time only, seeded)."""

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from genpool_sim import Model, fixed_tenants, simulate  # noqa: E402

SMALL = Model(slots=16, token_rate=50.0, prefill_s=0.02, groups=8, n=4, median_len=32.0, sigma=1.0, max_len=256,
              drift=0.0, pause_s=1.5, horizon_s=60.0, quantum_s=0.02)


@pytest.fixture(scope="module")
def runs():
    plans = fixed_tenants(4, SMALL, seed=1)
    return {mode: simulate(1, SMALL, mode, 1, plans) for mode in ("shared", "partitioned")}


def test_accounting_stays_within_capacity(runs):
    for r in runs.values():
        assert 0 < r.util <= 1.0
        assert r.tokens <= SMALL.slots * SMALL.token_rate * SMALL.horizon_s
        assert all(len(xs) >= 2 for xs in r.ttb.values())  # every tenant finished batches


def test_gap_filling_keeps_slots_busier_than_a_static_split(runs):
    # Partitioned caps each tenant at 4 of 16 slots; shared lets a tenant use the slots another
    # leaves idle while it trains, so it is busier and no tenant waits longer for its batches.
    shared, part = runs["shared"], runs["partitioned"]
    assert shared.util > part.util
    assert shared.tps > part.tps
    for t in shared.ttb:
        assert sorted(shared.ttb[t])[len(shared.ttb[t]) // 2] <= sorted(part.ttb[t])[len(part.ttb[t]) // 2]


def test_tenant_multipliers_shape_each_tenants_batches():
    plans = fixed_tenants(2, SMALL, seed=2)
    plans = [dataclasses.replace(plans[0], groups_x=0.25, pause_x=0.5), plans[1]]
    r = simulate(1, SMALL, "shared", 2, plans)
    small, big = (r.ttb[p.tid] for p in plans)
    # A quarter of the batch and half the pause: more, faster batches in the same time.
    assert len(small) > len(big)
    assert sum(small) / len(small) < sum(big) / len(big)


def test_sampling_ahead_overlaps_the_trainer_within_the_bound():
    # Trainer steps long enough that a synchronous pool idles while every tenant trains.
    m = dataclasses.replace(SMALL, pause_s=4.0)
    plans = fixed_tenants(4, m, seed=3)
    sync = simulate(1, m, "shared", 3, plans)
    ahead = simulate(1, dataclasses.replace(m, ahead=1), "shared", 3, plans)
    assert set(sync.staleness) == {0}  # synchronous: every batch trained on the version it sampled with
    assert max(ahead.staleness) == 1 and min(ahead.staleness) >= 0
    assert ahead.tps > sync.tps  # sampling while the trainer trains fills the pool
    mean = lambda r: sum(x for xs in r.ttb.values() for x in xs) / sum(len(xs) for xs in r.ttb.values())  # noqa: E731
    assert mean(ahead) < mean(sync)  # the trainer waits less for its batches


def test_episode_model_keeps_its_accounting():
    from genpool_episodes import Workload
    from genpool_episodes import simulate as episodes

    w = Workload(horizon_s=60.0)
    for regime in ("sync", "stream"):
        today, levels = episodes(w, regime, False, 0), episodes(w, regime, True, 0)
        for r in (today, levels):
            assert 0 < r["tps"] <= w.slots * w.token_rate
            assert r["episodes"] > 0 and r["batches"] > 0
            assert r["lat_p50"] <= r["lat_p95"] and r["ttb_p50"] <= r["ttb_p95"]


def test_a_step_curve_interpolates_and_holds_past_its_ends():
    m = dataclasses.replace(SMALL, step_ms=((1, 10.0), (8, 20.0), (16, 40.0)))
    assert m.rate(0) == m.rate(1) == 100.0
    assert m.rate(8) == 50.0 and m.rate(12) == pytest.approx(1000 / 30)
    assert m.rate(64) == 25.0
    assert SMALL.rate(64) == SMALL.token_rate  # no curve: flat


def test_a_flat_step_curve_runs_as_the_flat_model(runs):
    flat_curve = dataclasses.replace(SMALL, step_ms=((1, 1000 / SMALL.token_rate), (16, 1000 / SMALL.token_rate)))
    plans = fixed_tenants(4, SMALL, seed=1)
    for mode, r in runs.items():
        curved = simulate(1, flat_curve, mode, 1, plans)
        assert curved.ttb == r.ttb  # the same sequences finish in the same quanta
        assert curved.tokens == pytest.approx(r.tokens, rel=0.01)  # counted as they finish, not at admission


def test_a_step_growing_with_the_batch_slows_the_busier_mode_more(runs):
    # Shared runs more sequences at once, so a step that grows with the batch costs it more per
    # sequence than it costs the partition: its advantage shrinks but does not vanish.
    grows = dataclasses.replace(SMALL, step_ms=((1, 16.0), (16, 32.0)))
    plans = fixed_tenants(4, SMALL, seed=1)
    shared, part = simulate(1, grows, "shared", 1, plans), simulate(1, grows, "partitioned", 1, plans)
    flat_ratio = runs["shared"].tps / runs["partitioned"].tps
    assert 1.0 < shared.tps / part.tps < flat_ratio
    assert shared.tokens / shared.busy < part.tokens / part.busy  # per busy slot, slower
