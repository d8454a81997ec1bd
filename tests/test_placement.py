"""Trainer-shard placement as tables (scaleout.placement): where a new model goes, how a dead or
draining shard's models spread, and what the views read from Postgres and the beacons."""

from __future__ import annotations

import json

import pytest

from core import queue
from scaleout.placement import ShardView, place, spread, views_of


@pytest.mark.parametrize(("views", "expected"), [
    # the fewest models wins when no shard has computed anything lately
    ([ShardView("shard-0", models=3), ShardView("shard-1", models=1)], "shard-1"),
    # ties go to the lower name, so the choice is the same in every API process
    ([ShardView("shard-0"), ShardView("shard-1")], "shard-0"),
    # a shard busy with few models weighs against one idle with more: 1/4 + 9/10 vs 3/4 + 1/10
    ([ShardView("shard-0", models=1, recent_tokens=9000), ShardView("shard-1", models=3, recent_tokens=1000)],
     "shard-1"),
    # dead and draining shards take nothing, however empty
    ([ShardView("shard-0", models=5), ShardView("shard-1", alive=False), ShardView("shard-2", draining=True)],
     "shard-0"),
    ([ShardView("shard-0", alive=False), ShardView("shard-1", draining=True)], None),
    ([], None),
])
def test_place(views, expected):
    assert place(views) == expected


def test_spread_counts_each_model_before_placing_the_next():
    views = [ShardView("shard-0", alive=False, models=5), ShardView("shard-1", models=1), ShardView("shard-2")]
    moves = spread([f"m{i}" for i in range(5)], views)
    assert moves == {"m0": "shard-2", "m1": "shard-1", "m2": "shard-2", "m3": "shard-1", "m4": "shard-2"}
    assert spread(["m0"], [ShardView("shard-0", alive=False)]) == {}


def test_views_from_postgres_counts_and_beacons():
    names = queue.shard_names(3)
    views = views_of(names, {"shard-0": 4, "shard-2": 1}, {"shard-2"},
                     [json.dumps({"recent_tokens": 512}).encode(), None, json.dumps({}).encode()])
    assert views == [ShardView("shard-0", True, False, 4, 512.0), ShardView("shard-1", False, False, 0, 0.0),
                     ShardView("shard-2", True, True, 1, 0.0)]
    assert place(views) == "shard-0"


@pytest.mark.parametrize(("name", "count", "expected"), [
    ("shard-0", 2, "shard-0"), ("quilt-trainer-1", 2, "shard-1"), ("shard-2", 2, None), ("trainer", 2, None),
    ("shard-x", 2, None),
])
def test_a_worker_is_the_shard_its_name_ends_with(name, count, expected):
    if expected is None:
        with pytest.raises(ValueError, match="QUILT_TRAINER_SHARDS"):
            queue.shard_of(name, count)
    else:
        assert queue.shard_of(name, count) == expected
    assert queue.train_stream("b", "shard-1") == "quilt:train:b@shard-1"
    assert queue.train_streams("b", 1) == ["quilt:train:b"]
