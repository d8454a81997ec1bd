"""The soak's arithmetic (bench/soak.py): slopes per hour with their interval, and each process's
own warm-up left out of its series."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from soak import BOUNDS, growth_window, judge, judged_heaps, key_family, left_behind, settled, slope_per_hour  # noqa: E402


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


def _figures(**over):
    good = {"max_rss_slope_mib_per_h": 3.0, "redis_left_bytes_per_1k_requests": 1000.0,
            "postgres_bytes_per_1k_requests": 400_000.0, "http_5xx": 0, "lost": 0, "expired_on_disk": 0}
    return {**good, **over}


@pytest.mark.parametrize(("over", "broken"), [
    ({}, []),
    ({"max_rss_slope_mib_per_h": BOUNDS["max_rss_slope_mib_per_h"]}, []),  # at the bound is within it
    ({"max_rss_slope_mib_per_h": BOUNDS["max_rss_slope_mib_per_h"] + 0.01}, ["max_rss_slope_mib_per_h"]),
    ({"redis_left_bytes_per_1k_requests": 10 * BOUNDS["redis_left_bytes_per_1k_requests"]},
     ["redis_left_bytes_per_1k_requests"]),
    ({"postgres_bytes_per_1k_requests": None}, ["postgres_bytes_per_1k_requests"]),  # not measured: not kept
    ({"redis_left_bytes_per_1k_requests": -5e5}, []),  # shrinking is within
    ({"http_5xx": 1, "lost": 2}, ["http_5xx", "lost"]),
    ({"expired_on_disk": 3, "max_rss_slope_mib_per_h": None}, ["max_rss_slope_mib_per_h", "expired_on_disk"]),
])
def test_judge_names_each_broken_bound(over, broken):
    failed = judge(_figures(**over))
    assert [f.split()[0] for f in failed] == broken


def test_growth_is_measured_once_what_is_kept_for_a_while_has_filled_up():
    looks = [(float(t), {"x": float(t)}, t) for t in range(180, 1200, 15)]
    (t0, _, _), (t1, _, _) = growth_window(looks, steady_from_s=480.0, min_span_s=240.0)
    assert (t0, t1) == (480.0, 1185.0)
    # too short a run for a steady window: from the first look
    (t0, _, _), _ = growth_window(looks[:30], steady_from_s=480.0, min_span_s=240.0)
    assert t0 == 180.0
    assert growth_window([], steady_from_s=0.0, min_span_s=0.0) is None


def _run_report(capsys, pg_bytes_per_request: float) -> dict:
    import json
    from types import SimpleNamespace

    from soak import Tally, report

    args = SimpleNamespace(minutes=20.0, every_s=15.0, warmup_minutes=3.0, retention_s=300)
    tenants = [SimpleNamespace(role="sft", tally=Tally(calls=100))]
    looks, series = [], {}
    for i, t in enumerate(range(180, 1200, 15)):
        requests = 1000.0 + 6 * (t - 180)  # 6 accepted a second
        look = {"pg_requests_inserted": requests, "redis_used_memory": 9e6 + (i % 3) * 1e4,
                "pg_database_bytes": 1e7 + pg_bytes_per_request * requests, "anon_mib:api:1": 300.0}
        looks.append((float(t), look, 10 * i))
        for name, value in look.items():
            series.setdefault(name, []).append((float(t), value))
    after = {**looks[-1][1], "redis_used_memory": 9e6 + 20_000.0}  # the load stopped, the TTLs passed
    report(args, tenants, series, looks, on_disk=[], restarted=True, after=after)
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_the_report_judges_its_figures_over_the_steady_window(capsys):
    out = _run_report(capsys, pg_bytes_per_request=800.0)  # a ledger row and a share of run metrics
    assert out["growth_window_s"] == [480, 1185] and out["requests_in_window"] == 6 * 705
    assert out["postgres_bytes_per_1k_requests"] == pytest.approx(800_000, rel=1e-3)
    assert abs(out["redis_bytes_per_1k_requests"]) < 10_000 and out["max_rss_slope_mib_per_h"] == 0.0
    assert 0 < out["redis_left_bytes_per_1k_requests"] < 10_000
    assert out["within_bounds"] is True and out["failed_bounds"] == []
    leak = _run_report(capsys, pg_bytes_per_request=800.0 + 730.0)  # and each request's row kept
    assert leak["within_bounds"] is False
    assert [f.split()[0] for f in leak["failed_bounds"]] == ["postgres_bytes_per_1k_requests"]


def test_the_rss_bound_judges_the_processes_alive_at_the_end():
    looks = [float(t) for t in range(180, 1200, 15)]
    series = {"anon_mib:trainer:1": [(t, 300 + t / 10) for t in looks if t < 600],  # killed mid-run
              "anon_mib:trainer:2": [(t, 640.0) for t in looks if t >= 780],  # its replacement
              "anon_mib:api:3": [(t, 200.0) for t in looks],
              "anon_mib:postgres:4": [(t, 3.0) for t in looks[-5:]],  # too few looks to fit
              "redis_used_memory": [(t, 9e6) for t in looks]}
    assert judged_heaps(series, ended_s=looks[-1]) == {"anon_mib:trainer:2", "anon_mib:api:3"}


@pytest.mark.parametrize("key, family", [("quilt:future:req-1", "quilt:future"), ("quilt:stability:t:req-1:0", "quilt:stability"),
                                         ("celery", "celery"), ("_kombu.binding.celery", "_kombu.binding.celery"),
                                         ("celery-task-meta-0259cb37-f71c-42d9-99f4-67a3d75633fa", "celery-task-meta")])
def test_keys_are_counted_by_family(key, family):
    assert key_family(key) == family


def test_what_outlives_its_requests_is_counted_per_thousand():
    first = {"pg_requests_inserted": 1000.0, "redis_used_memory": 5e6, "redis_keys:quilt:future": 700.0,
             "redis_keys:celery-task-meta": 10.0}
    after = {"pg_requests_inserted": 11000.0, "redis_used_memory": 5.5e6, "redis_keys:quilt:future": 0.0,
             "redis_keys:celery-task-meta": 40.0, "redis_keys:quilt:stability": 3.0}
    assert left_behind(first, after) == {"redis_left_bytes": 5e5, "redis_left_bytes_per_1k_requests": 50_000.0,
                                         "left:celery-task-meta": 30.0, "left:quilt:stability": 3.0}
    # fewer bytes than at the first look (its live futures gone): nothing left behind
    assert left_behind(first, {**after, "redis_used_memory": 4e6})["redis_left_bytes_per_1k_requests"] == -100_000.0
    assert left_behind(first, {"pg_requests_inserted": 1000.0})["redis_left_bytes_per_1k_requests"] is None
