"""The soak's arithmetic (bench/soak.py): slopes per hour with their interval, and each process's
own warm-up left out of its series."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from soak import settled, slope_per_hour  # noqa: E402


@pytest.mark.parametrize(("points", "slope", "ci_below"), [
    ([(t * 60.0, 100.0) for t in range(10)], 0.0, 1e-9),  # flat
    ([(t * 60.0, 100.0 + t) for t in range(10)], 60.0, 1e-9),  # 1 a minute: 60 an hour, exactly
    ([(t * 60.0, 100.0 + t + (0.5 if t % 2 else -0.5)) for t in range(20)], 60.0, 10.0),  # with noise
])
def test_slopes_per_hour(points, slope, ci_below):
    b, ci = slope_per_hour(points)
    assert b == pytest.approx(slope, abs=1.0) and 0 <= ci < ci_below


def test_too_few_points_or_one_instant_give_no_slope():
    assert slope_per_hour([(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]) is None
    assert slope_per_hour([(5.0, 1.0)] * 6) is None


def test_a_process_born_late_is_fitted_after_its_own_warmup():
    series = {"rss_mib:trainer:1": [(t, 400.0) for t in range(0, 600, 60)],
              "rss_mib:trainer:2": [(t, 100.0 + t) for t in range(300, 900, 60)],  # restarted at 300 s
              "redis_used_memory": [(t, 1.0) for t in range(0, 600, 60)]}
    out = settled(series, warmup_s=180)
    assert out["rss_mib:trainer:1"] == series["rss_mib:trainer:1"]
    assert out["redis_used_memory"] == series["redis_used_memory"]
    assert [t for t, _ in out["rss_mib:trainer:2"]] == list(range(480, 900, 60))
