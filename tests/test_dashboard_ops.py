"""The operator page's numbers, shaped by pure functions over plain rows (no services)."""

from __future__ import annotations

import pytest

from api.dashboard import ops


def test_bins_are_aligned_and_cover_the_window():
    assert ops.bin_edges(now=1005.0, window_s=30, bin_s=10) == [980.0, 990.0, 1000.0]


def test_busy_fraction_spreads_a_round_over_the_bins_it_overlaps():
    rounds = [{"at": 1005.0, "compute_s": 10.0}, {"at": 1008.0, "compute_s": 2.0}]
    series = ops.trainer_series(rounds, now=1009.0, window_s=30, bin_s=10, complete=True)
    assert series["t"] == [980.0, 990.0, 1000.0]
    assert series["busy"] == [0.0, 0.5, 0.7]  # 5 s of the first round in each bin, + 2 s
    assert series["waiting"] == [1.0, 0.5, 0.3]


def test_shards_busy_side_by_side_are_averaged():
    rounds = [{"at": 1010.0, "compute_s": 8.0, "shard": "shard-0"}, {"at": 1010.0, "compute_s": 6.0, "shard": "shard-1"}]
    series = ops.trainer_series(rounds, now=1009.0, window_s=20, bin_s=10, complete=True, workers=2)
    assert series["busy"] == [0.0, 0.7]  # (8 + 6) / (10 s x 2 shards), not 1.4 capped to 1


def test_busy_bins_before_trimmed_history_are_unknown():
    series = ops.trainer_series([{"at": 1005.0, "compute_s": 1.0}], now=1009.0, window_s=30, bin_s=10, complete=False)
    assert series["busy"] == [None, None, 0.1]


def test_fused_rounds_skip_barrier_only_rounds_and_average():
    rounds = [{"at": 3.0, "tenants": 2, "models": 3, "tokens": 100, "padding_fraction": 0.2},
              {"at": 1.0, "tenants": 0, "models": 0, "tokens": 0, "padding_fraction": 0.0},  # optim_step only
              {"at": 2.0, "tenants": 4, "models": 4, "tokens": 300, "padding_fraction": 0.0}]
    fused = ops.fused_rounds(rounds, since=0.0)
    assert fused["t"] == [2.0, 3.0] and fused["tenants"] == [4, 2]
    assert fused["mean"] == {"tenants": 3.0, "models": 3.5, "tokens": 200.0, "padding_fraction": 0.1}


def test_rate_series_is_tokens_per_second_per_bin():
    rows = [{"t": 990, "sample": 50, "train": 20}, {"t": 1000, "sample": 0, "train": 100},
            {"t": 500, "sample": 9, "train": 9}]  # the last is outside the window
    rates = ops.rate_series(rows, now=1009.0, window_s=30, bin_s=10)
    assert rates["generated_tokens_per_s"] == [0.0, 5.0, 0.0]
    assert rates["trained_tokens_per_s"] == [0.0, 2.0, 10.0]


def test_staleness_histogram_rounds_and_caps():
    h = ops.histogram([0.0, 0.4, 1.6, 2.0, 30.0], buckets=3)
    assert h == {"labels": ["0", "1", "2", "3+"], "counts": [2, 0, 2, 1], "n": 5}


def test_shares_sum_to_one_and_group_the_tail(monkeypatch):
    monkeypatch.setattr(ops, "MAX_TENANTS_SHOWN", 2)
    rows = [{"tenant": "a", "train": 30, "sample": 0, "cost": 6}, {"tenant": "b", "train": 10, "sample": 50, "cost": 3},
            {"tenant": "c", "train": 0, "sample": 50, "cost": 1}, {"tenant": "d", "train": 60, "sample": 0, "cost": 0}]
    s = ops.shares(rows)
    assert s["tenants"] == ["a", "b", "2 others"]
    assert s["trainer"] == [0.3, 0.1, 0.6] and s["generator"] == [0.0, 0.5, 0.5] and s["cost"] == [0.6, 0.3, 0.1]
    assert sum(s["cost"]) == pytest.approx(1.0)


def test_shares_of_nothing_are_zero():
    assert ops.shares([]) == {"tenants": [], "trainer": [], "generator": [], "cost": [], "train_tokens": 0,
                              "sample_tokens": 0, "cost_micro_usd": 0}


def test_env_waits_order_by_rollout_share_and_keep_missing_values():
    rows = [{"tenant": "a", "steps": 3, "rollout": 0.2, "trainer": 0.1, "start_s": 6.01234, "step_s": 1.5,
             "reward_s": None, "sample_s": 2.0, "train_s": 0.5, "lost_s": 4.25},
            {"tenant": "b", "steps": 1, "rollout": 0.7, "trainer": None}]  # steps from before the seconds
    assert ops.env_waits(rows) == {"tenants": ["b", "a"], "rollout": [0.7, 0.2], "trainer": [None, 0.1],
                                   "steps": [1, 3], "start_s": [None, 6.012], "step_s": [None, 1.5],
                                   "reward_s": [None, None], "sample_s": [None, 2.0], "train_s": [None, 0.5],
                                   "lost_s": [None, 4.25]}


def test_capacity_reads_generation_and_trainer_busy():
    base = {"gen": {"slot_s": 90.0, "capacity_s": 100.0}, "busy": {"busy": [None, 0.4, 0.6]}}
    c = ops.capacity(base, 0.0, (4, 4))
    assert c["gen_busy"] == 0.9 and c["trainer_busy"] == 0.5
    assert c["recommended"] == [5, 3] and c["reason"] == "balance busy time"
    assert c["balanced_gen_share"] == pytest.approx(0.9 / 1.4, abs=1e-4)
    assert ops.capacity({"gen": None, "busy": {"busy": [0.5]}}, 0.0, (1, 1)) is None
    assert ops.capacity({"gen": {"slot_s": 1.0, "capacity_s": 2.0}, "busy": {"busy": [None]}}, 0.0, (1, 1)) is None


def test_with_a_scaler_the_planner_counts_the_devices_in_service_and_shows_its_last_move(monkeypatch):
    from core.settings import clear_settings_cache
    from scaleout.in_service import InService

    monkeypatch.setenv("QUILT_SCALER_DEVICES_PER_GEN_REPLICA", "2")
    clear_settings_cache()
    try:
        assert ops.devices_in_service(InService(), (4, 4)) == (4, 4)  # no scaler: as configured
        record = InService(gen=3, trainer=2, reason="balance busy time", at=10.0)
        assert ops.devices_in_service(record, (4, 4)) == (6, 2)
        base = {"gen": {"slot_s": 90.0, "capacity_s": 100.0}, "busy": {"busy": [0.5]}}
        c = ops.capacity(base, 0.0, ops.devices_in_service(record, (4, 4)), record)
        assert c["now"] == [6, 2]
        assert c["scaler"] == {"gen": 3, "trainer": 2, "reason": "balance busy time", "at": 10.0}
        assert "scaler" not in ops.capacity(base, 0.0, (4, 4), InService())
    finally:
        monkeypatch.delenv("QUILT_SCALER_DEVICES_PER_GEN_REPLICA")
        clear_settings_cache()


def test_generation_replicas_add_up_and_each_shows():
    one = {"running": 3, "target": 8, "slot_s": 2.0, "capacity_s": 4.0, "group_latency_p95_s": 1.5}
    assert ops.combined_gen({"b": one}) is one  # one worker: its beacon as it is
    assert ops.combined_gen({"b@gen-0": None, "b@gen-1": None}) is None
    both = ops.combined_gen({"b@gen-0": one, "b@gen-1": {**one, "running": 5, "adapter_hits": 2}, "b@gen-2": None})
    assert (both["running"], both["target"], both["slot_s"], both["capacity_s"]) == (8, 16, 4.0, 8.0)
    assert both["adapter_hits"] == 2 and both["replicas"]["b@gen-2"] is None
    assert both["replicas"]["b@gen-1"]["running"] == 5


def test_trainer_shards_add_up_and_each_shows_its_fusion():
    one = {"rounds": 10, "busy_s": 2.0, "wait_s": 8.0, "models": 3, "queued": 1, "recent_tokens": 640,
           "tenants_fused": 15, "fused_rounds": 5}
    assert ops.combined_trainer({"b": one}) is one  # one trainer: its beacon as it is
    assert ops.combined_trainer({"b@shard-0": None, "b@shard-1": None}) is None
    both = ops.combined_trainer({"b@shard-0": one, "b@shard-1": {**one, "models": 1, "fused_rounds": 15},
                                 "b@shard-2": None})
    assert (both["rounds"], both["busy_s"], both["models"], both["recent_tokens"]) == (20, 4.0, 4, 1280)
    assert both["shards"]["b@shard-2"] is None
    assert both["shards"]["b@shard-0"]["tenants_per_pass"] == 3.0 and both["shards"]["b@shard-1"]["models"] == 1
