"""Routing sample groups across generation replicas as tables (gen_pool.routing), and the model
that measures it (bench/genpool_route_sim.py, simulated time only)."""

import sys
from pathlib import Path

from gen_pool.routing import ReplicaView, RouteRequest, RouteWeights, route

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from genpool_route_sim import Model, simulate  # noqa: E402


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
