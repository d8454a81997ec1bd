"""Routing sample groups across generation replicas as tables (gen_pool.routing), and the model
that measures it (bench/genpool_route_sim.py, simulated time only)."""

import sys
from pathlib import Path

import pytest

from core import queue
from gen_pool.routing import (
    ReplicaView,
    RouteRequest,
    RouteWeights,
    pick,
    prefix_hash,
    route,
    view_of,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from genpool_route_sim import Model, common_batches, simulate  # noqa: E402


def r(name, running=0, waiting=0, target=64, **kw):
    return ReplicaView(name, running, waiting, target, **kw)


def test_the_replica_holding_the_adapter_wins_at_equal_load():
    replicas = [r("a"), r("b", adapters=frozenset({"t1"})), r("c", cached_adapters=frozenset({"t1"}))]
    assert route(RouteRequest(8, "t1"), replicas) == 1
    # Not resident anywhere, but in one CPU cache: cheaper to activate there.
    replicas = [r("a"), r("b"), r("c", cached_adapters=frozenset({"t1"}))]
    assert route(RouteRequest(8, "t1"), replicas) == 2


def test_load_outweighs_affinity_past_a_point_and_the_bound_filters():
    busy = r("b", running=64, waiting=16, adapters=frozenset({"t1"}))  # load (80 + 8) / 64 = 1.375
    assert route(RouteRequest(8, "t1"), [r("a"), busy]) == 1  # 3 - 2.75 = 0.25 beats -0.25
    full = r("b", running=64, waiting=32, adapters=frozenset({"t1"}))  # past 1.5 x target: filtered
    assert route(RouteRequest(8, "t1"), [r("a", running=60), full]) == 0
    # Every replica past the bound: the least bad one still gets it.
    assert route(RouteRequest(8, "t1"), [r("a", running=200), full]) == 1


def test_prefix_and_episode_affinity_break_ties_and_health_filters():
    replicas = [r("a"), r("b", prefixes=frozenset({7})), r("c", sessions=frozenset({"ep"}))]
    assert route(RouteRequest(4, None, prefix=7), replicas) == 1
    assert route(RouteRequest(4, None, prefix=7, session="ep"), replicas) == 2  # session 2 > prefix 1
    sick = [r("a", healthy=False, adapters=frozenset({"t1"})), r("b")]
    assert route(RouteRequest(4, "t1"), sick) == 1
    assert route(RouteRequest(4, "t1"), [r("a", healthy=False)]) is None
    assert route(RouteRequest(4, None), [r("a"), r("b")]) == 0  # ties: the lower index


def test_weights_change_the_balance():
    busy = r("b", running=64, waiting=16, adapters=frozenset({"t1"}))
    assert route(RouteRequest(8, "t1"), [r("a"), busy], RouteWeights(load=4.0)) == 0


def test_routing_keeps_adapters_resident_where_round_robin_thrashes():
    m = Model(horizon_s=120.0)
    quilt, rr = simulate(8, m, "quilt", 0), simulate(8, m, "round_robin", 0)
    assert quilt["hit_rate"] > 0.9 > 0.1 > rr["hit_rate"]
    assert quilt["tps"] >= rr["tps"]


def test_a_workers_replica_follows_its_names_ordinal():
    assert [queue.replica_of(n, 3) for n in ("gen-0", "gen-2", "quilt-gen-1")] == ["gen-0", "gen-2", "gen-1"]
    for bad in ("gen-3", "quilt-gen", "gen-x", "-1", "7"):
        with pytest.raises(ValueError, match="QUILT_GEN_REPLICAS"):
            queue.replica_of(bad, 3)


def test_the_baselines_pick_among_healthy_replicas_and_hashes_agree_across_processes():
    views = [view_of("gen-0", {"running": 1}), view_of("gen-1", None), view_of("gen-2", {})]
    assert not views[1].healthy and views[0].running == 1
    assert [pick("round_robin", RouteRequest(1), views, turn=t) for t in range(4)] == [0, 2, 0, 2]
    assert {pick("random", RouteRequest(1), views) for _ in range(50)} == {0, 2}
    assert pick("affinity", RouteRequest(1), [views[1]]) is None
    # blake2b, not Python's salted hash: the API and every replica agree; only the head counts.
    assert prefix_hash(list(range(40))) == prefix_hash(list(range(32)) + [99]) == 7901985425503095
    assert prefix_hash([1, 2]) != prefix_hash([2, 1]) and prefix_hash([]) >= 0


def test_tenants_are_compared_over_the_batches_both_policies_completed():
    # A tenant's 3rd batch that only one policy reached within the horizon is not held against it;
    # a tenant with no batch under one of them is left out.
    assert common_batches([[1.0, 2.0, 9.0], []], [[2.0, 3.0], [4.0]]) == [([1.0, 2.0], [2.0, 3.0])]
