"""The API's event-loop lag (core.loop_lag): the histogram's arithmetic as tables, a blocked loop
seen as a late wake-up, and the running API publishing its histogram to /metrics."""

from __future__ import annotations

import asyncio
import json
import math
import time

import pytest

from core import loop_lag
from core.loop_lag import BOUNDS, LagHistogram


def _hist(at_ms: dict) -> LagHistogram:
    """A histogram with n observations in the bucket whose upper bound is each key, in ms (inf: past the last)."""
    counts = [0] * (len(BOUNDS) + 1)
    for ms, n in at_ms.items():
        counts[len(BOUNDS) if ms == math.inf else BOUNDS.index(ms / 1000)] = n
    return LagHistogram(counts, 0.0)


@pytest.mark.parametrize(("late_s", "bucket_bound"), [
    (0.0, 0.0005), (0.0005, 0.0005), (0.0006, 0.001), (0.0049, 0.005), (0.02, 0.02), (0.7, 1.0), (3.0, None)])
def test_a_lateness_lands_in_the_bucket_bounding_it(late_s, bucket_bound):
    h = LagHistogram()
    h.observe(late_s)
    index = len(BOUNDS) if bucket_bound is None else BOUNDS.index(bucket_bound)
    assert h.counts[index] == 1 and h.count == 1 and h.sum_s == late_s


@pytest.mark.parametrize(("hist", "q", "expected_s"), [
    (_hist({1: 100}), 0.5, 0.00075),            # halfway into (0.5 ms, 1 ms]
    (_hist({0.5: 50, 10: 50}), 0.5, 0.0005),    # exactly the first bucket's top
    (_hist({0.5: 50, 10: 50}), 0.75, 0.0075),   # halfway into (5 ms, 10 ms]
    (_hist({0.5: 99, 50: 1}), 0.99, 0.0005),
    (_hist({0.5: 98, 50: 2}), 0.99, 0.035),     # half of the (20, 50] bucket's two
    (_hist({0.5: 1, math.inf: 1}), 0.99, 1.0),        # past the last bound: that bound
])
def test_quantiles_interpolate_inside_their_bucket(hist, q, expected_s):
    assert math.isclose(hist.quantile(q), expected_s, rel_tol=1e-9)


def test_an_empty_histogram_has_no_quantile_and_differences_are_per_bucket():
    assert math.isnan(LagHistogram().quantile(0.99))
    before, after = _hist({1: 5, 20: 1}), _hist({1: 9, 20: 1, 100: 2})
    assert after.minus(before).counts == _hist({1: 4, 100: 2}).counts
    assert before.plus(after.minus(before)).counts == after.counts
    assert LagHistogram.from_json(after.to_json()) == after
    with pytest.raises(ValueError, match="buckets"):
        LagHistogram.from_json({"counts": [1, 2], "sum_s": 0.0})


def test_a_blocked_loop_shows_as_a_late_wake_up():
    """A step that holds the loop for 80 ms delays the probe's next wake-up by at least that, less
    one probe period: a lower bound, whatever the machine's speed."""
    async def run() -> LagHistogram:
        hist = LagHistogram()
        probe = asyncio.create_task(loop_lag.watch(hist, every_s=0.005))
        await asyncio.sleep(0.05)
        time.sleep(0.08)  # noqa: ASYNC251 - a call's step that never yields
        await asyncio.sleep(0.05)
        probe.cancel()
        return hist

    hist = asyncio.run(run())
    assert sum(c for b, c in zip(BOUNDS, hist.counts) if b > 0.05) + hist.counts[-1] >= 1, hist
    assert hist.sum_s >= 0.075


def test_beacons_decode_by_instance_leaving_out_lapsed_and_foreign_ones():
    good = json.dumps({"at": 0, "lag": _hist({1: 3}).to_json()})
    other_bounds = json.dumps({"at": 0, "lag": {"counts": [1, 2, 3], "sum_s": 0.1}})
    names = loop_lag.instances({b"h:3", b"h:1", b"h:2", b"h:4"})
    assert names == ["h:1", "h:2", "h:3", "h:4"]
    hists, gone = loop_lag.decode(names, [good, None, other_bounds, "not json"])
    assert hists == {"h:1": _hist({1: 3})} and gone == ["h:2"]


@pytest.mark.stack
def test_the_api_publishes_its_loop_lag_to_metrics(stack, r):
    deadline = time.monotonic() + 30
    while True:
        text = stack.http(None).get(stack.base_url + "/metrics").text
        counts = [line for line in text.splitlines() if line.startswith("quilt_api_event_loop_lag_seconds_count{")]
        if counts and float(counts[0].rsplit(" ", 1)[1]) > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert counts, text[-2000:]  # one series per API process, labelled by its instance
    assert 'le="+Inf"' in text and "quilt_api_event_loop_lag_seconds_sum{" in text
    assert float(counts[0].rsplit(" ", 1)[1]) > 0
    # The beacon a reader such as bench/api_load.py differences over a run. A process started in
    # the last beat (another test's API) may have published before its first wake-up, and one that
    # died keeps its last beacon until the TTL: wait those out.
    deadline = time.monotonic() + loop_lag.BEACON_TTL_S + 5
    while True:
        names = loop_lag.instances(r.smembers(loop_lag.INDEX_KEY))
        hists, gone = loop_lag.decode(names, r.mget([loop_lag.beacon_key(n) for n in names]))
        if all(h.count > 0 for h in hists.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert hists and all(h.count > 0 for h in hists.values()), hists
    assert 0 < r.ttl(loop_lag.INDEX_KEY) <= loop_lag.BEACON_TTL_S  # the index outlives no process
    # An instance whose beacon lapsed (a process gone) leaves the index at the next reading.
    r.sadd(loop_lag.INDEX_KEY, "gone-host:1")
    assert "gone-host:1" not in stack.http(None).get(stack.base_url + "/metrics").text
    assert b"gone-host:1" not in r.smembers(loop_lag.INDEX_KEY)
