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
