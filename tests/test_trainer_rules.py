"""The trainer's rules apart from its loop, as tables: the replay log (batcher.replay) and shard
membership (batcher.shards) against a fake database call and a fake Redis."""

from __future__ import annotations

import pytest

from batcher.queues import ModelQueues
from batcher.replay import ReplayLog
from batcher.shards import ShardMembership
from core import health, queue
from core.consumer import Delivery
from core.loss_spec import LossConfig
from core.work import (
    AdamParams,
    CreateModel,
    LoadWeights,
    LoraShape,
    OptimStep,
    PassWork,
    Rejected,
    SaveWeights,
    WorkItem,
    WorkKind,
)
from scaleout import placement

_SAVE = SaveWeights("s", "/tmp/s", overwrite=True)
_BODIES = {WorkKind.CREATE_MODEL: CreateModel(LoraShape(rank=4)), WorkKind.OPTIM_STEP: OptimStep(AdamParams()),
           WorkKind.FORWARD: PassWork("cross_entropy", LossConfig(), ()),
           WorkKind.FORWARD_BACKWARD: PassWork("cross_entropy", LossConfig(), ()),
           WorkKind.SAVE_WEIGHTS: _SAVE, WorkKind.SAVE_WEIGHTS_FOR_SAMPLER: _SAVE,
           WorkKind.SAVE_WEIGHTS_EXTERNAL: _SAVE, WorkKind.LOAD_WEIGHTS: LoadWeights("/tmp/a", True, "tinker://m/weights/a"),
           WorkKind.REJECTED: Rejected("bad", "seq_id")}


def item(kind: WorkKind, seq: int = 1, model: str = "m", request: str | None = None) -> WorkItem:
    return WorkItem(request or f"r{seq}", "ten", model, seq, kind, 4, _BODIES[kind])


# ------------------------------------------------------------------ the replay log

@pytest.mark.parametrize(("kind", "finished", "failed_before", "skipped"), [
    (WorkKind.FORWARD, True, False, True),  # answered, changes nothing
    (WorkKind.SAVE_WEIGHTS, True, False, True),
    (WorkKind.SAVE_WEIGHTS_FOR_SAMPLER, True, False, True),
    (WorkKind.SAVE_WEIGHTS_EXTERNAL, True, False, True),
    (WorkKind.REJECTED, True, False, True),
    (WorkKind.FORWARD_BACKWARD, True, False, False),  # its gradient is part of the state
    (WorkKind.OPTIM_STEP, True, False, False),
    (WorkKind.LOAD_WEIGHTS, True, False, False),
    (WorkKind.CREATE_MODEL, True, False, False),
    (WorkKind.FORWARD_BACKWARD, True, True, True),  # it failed: no gradient to replay
    (WorkKind.OPTIM_STEP, True, True, True),
    (WorkKind.FORWARD, False, False, False),  # not answered yet: it runs
    (WorkKind.FORWARD_BACKWARD, False, True, False),
])
def test_a_replay_skips_answered_requests_without_effect(kind, finished, failed_before, skipped):
    log = ReplayLog()
    log.note_finished({"r1": "failed" if failed_before else "done"})
    assert log.without_effect(Delivery("1-0", item(kind), finished=finished)) is skipped


@pytest.mark.parametrize(("every", "kinds", "due"), [
    (1, [WorkKind.OPTIM_STEP], [True]),
    (3, [WorkKind.OPTIM_STEP] * 4, [False, False, True, False]),
    (3, [WorkKind.CREATE_MODEL], [True]),  # replaces the state: always
    (3, [WorkKind.LOAD_WEIGHTS], [True]),
    (3, [WorkKind.SAVE_WEIGHTS, WorkKind.REJECTED], [False, False]),
    (2, [WorkKind.OPTIM_STEP, WorkKind.LOAD_WEIGHTS, WorkKind.OPTIM_STEP], [False, True, False]),  # a load restarts the count
])
def test_snapshots_follow_state_replacing_barriers_and_every_nth_step(every, kinds, due):
    log = ReplayLog(snapshot_every_steps=every)
    got = []
    for seq, kind in enumerate(kinds):
        is_due = log.snapshot_due(item(kind, seq))
        got.append(is_due)
        if is_due:
            log.snapshotted("m")
    assert got == due


def test_entries_are_held_until_a_snapshot_and_released_once():
    log = ReplayLog()
    log.hold("m", "1-0")
    log.hold("m", "2-0")
    log.hold("other", "3-0")
    assert log.snapshotted("m") == ["1-0", "2-0"]
    assert log.release("m") == []
    assert log.release("other") == ["3-0"]


@pytest.mark.parametrize(("recovering", "next_seq", "ready", "left"), [
    ({"a": None}, {"a": 5}, ["a"], {}),  # nothing to replay
    ({"a": 7}, {"a": 5}, [], {"a": 7}),  # still replaying up to 7
    ({"a": 7}, {"a": 8}, ["a"], {}),  # replayed
    ({"a": 7, "b": 2}, {"b": 3}, ["b"], {}),  # a was deleted meanwhile: forgotten, not 'ready'
])
def test_a_restored_model_is_ready_once_its_log_has_run(recovering, next_seq, ready, left):
    log = ReplayLog(recovering=dict(recovering))
    assert log.recovered(next_seq) == ready
    assert log.recovering == left


def test_a_drained_model_is_forgotten_whole():
    log = ReplayLog(held={"m": ["1-0"]}, recovering={"m": 3}, steps_since_snapshot={"m": 2})
    log.forget("m")
    assert (log.held, log.recovering, log.steps_since_snapshot) == ({}, {}, {})


# ------------------------------------------------------------------ shard membership

class FakeRedis:
    """The few Redis calls membership makes: streams of entries, keys that exist, moves recorded."""

    def __init__(self, streams: dict[str, list[WorkItem]] | None = None, keys: set[str] = frozenset()):
        self.streams = {name: [(f"{i}-0", it.to_fields()) for i, it in enumerate(items, 1)]
                        for name, items in (streams or {}).items()}
        self.keys = set(keys)
        self.moves: list[tuple[str, str, str]] = []  # (source, entry, destination)

    def exists(self, key: str) -> int:
        return int(key in self.keys)

    def delete(self, key: str) -> None:
        self.keys.discard(key)

    def eval(self, script, n, source, destination, entry_id, group, field):
        self.moves.append((source, entry_id, destination))
        self.streams[source] = [(e, f) for e, f in self.streams.get(source, []) if e != entry_id]
        return 1

    def xrange(self, stream, min, max, count):
        after = min[1:] if min.startswith("(") else None
        entries = self.streams.get(stream, [])
        if after is not None:
            entries = [(e, f) for e, f in entries if tuple(map(int, e.split("-"))) > tuple(map(int, after.split("-")))]
        return entries[:count]


def fake_db(owners: dict[str, tuple[str | None, str]], **answers):
    """A db_call answering placement's reads from tables; records what it was asked."""
    asked = []

    def call(record, *args, **kwargs):
        asked.append(record.__name__)
        if record is placement.owners:
            return {m: owners[m] for m in args[0] if m in owners}
        if record is placement.place_unplaced:
            return answers.get("place_unplaced", "shard-0")
        return answers[record.__name__]
    call.asked = asked
    return call


BASE = "b"
MINE = queue.train_stream(BASE, "shard-0")


def membership(redis, db, shard="shard-0", shards=2):
    return ShardMembership(redis=redis, base_model=BASE, shard=shard, shards=shards,
                           stream=queue.train_stream(BASE, shard), db_call=db)


@pytest.mark.parametrize(("owner", "local", "kept", "forwarded_to", "creating", "adopt"), [
    (("shard-0", "ready"), True, True, None, set(), []),  # held here already
    (("shard-0", "ready"), False, True, None, set(), ["m"]),  # re-placed here: adopt
    (("shard-0", "recovering"), False, True, None, set(), ["m"]),
    (("shard-0", "creating"), False, True, None, {"m"}, []),  # its create runs here first
    (("shard-1", "ready"), False, False, "shard-1", set(), []),  # another shard's: forwarded
    (("shard-1", "creating"), False, False, "shard-1", set(), []),
    ((None, "deleted"), False, True, None, set(), []),  # gone: kept, to be failed as lost
    (("shard-1", "lost"), False, True, None, set(), []),
    ((None, "ready"), False, True, None, set(), ["m"]),  # from before shards: placed now (here)
])
def test_deliveries_are_sorted_by_the_shard_their_model_is_placed_on(owner, local, kept, forwarded_to, creating,
                                                                     adopt):
    redis = FakeRedis()
    d = Delivery("7-0", item(WorkKind.FORWARD_BACKWARD))
    out = membership(redis, fake_db({"m": owner})).sort([d, Delivery("8-0", item(WorkKind.OPTIM_STEP, 2))],
                                                         lambda m: local)
    assert [x.stream_id for x in out.kept] == (["7-0", "8-0"] if kept else [])
    assert redis.moves == ([] if forwarded_to is None else
                           [(MINE, "7-0", queue.train_stream(BASE, forwarded_to)),
                            (MINE, "8-0", queue.train_stream(BASE, forwarded_to))])
    assert (out.creating, out.adopt) == (creating, adopt)


def test_without_shards_nothing_is_sorted_or_asked():
    db = fake_db({})
    deliveries = [Delivery("1-0", item(WorkKind.FORWARD))]
    out = membership(FakeRedis(), db, shard=None, shards=1).sort(deliveries, lambda m: False)
    assert out.kept == deliveries and db.asked == []


def test_a_dead_peers_models_are_replaced_and_its_entries_follow_them():
    dead = queue.train_stream(BASE, "shard-1")
    redis = FakeRedis({dead: [item(WorkKind.FORWARD, 1, "a"), item(WorkKind.FORWARD, 1, "gone")]},
                      keys={health.consumer_key(MINE, "shard-0")})
    db = fake_db({"a": ("shard-0", "ready")}, stray_shards=[], models_on=["a"], replace_dead={"a": "shard-0"})
    membership(redis, db).take_over_dead()
    assert "replace_dead" in db.asked
    # both come here: `a` is placed here now, and `gone` is failed here as lost
    assert redis.moves == [(dead, "1-0", MINE), (dead, "2-0", MINE)]


def test_a_live_peer_is_left_alone():
    peer = queue.train_stream(BASE, "shard-1")
    redis = FakeRedis({peer: [item(WorkKind.FORWARD, 1, "a")]},
                      keys={health.consumer_key(peer, "shard-1")})
    db = fake_db({}, stray_shards=[])
    membership(redis, db).take_over_dead()
    assert redis.moves == [] and "replace_dead" not in db.asked


@pytest.mark.parametrize(("draining", "mine", "moved", "expected"), [
    (False, ["a"], {"a": "shard-1"}, []),
    (True, [], {}, []),
    (True, ["a", "b"], {}, []),  # no other shard open: they stay
    (True, ["a", "b"], {"a": "shard-1", "b": "shard-1"}, ["a", "b"]),
])
def test_a_draining_shard_hands_on_its_models(draining, mine, moved, expected):
    db = fake_db({}, is_draining=draining, models_on=mine, move_off=moved)
    assert membership(FakeRedis(), db).to_drain() == expected


def test_a_fence_means_restart_until_a_fresh_start_clears_it():
    redis = FakeRedis(keys={placement.fence_key(BASE, "shard-0")})
    shard = membership(redis, fake_db({}))
    assert shard.fenced()
    shard.clear_fence()
    assert not shard.fenced()


def test_idle_models_placed_here_are_adopted_unless_held():
    db = fake_db({}, recovering_on=["a", "b"])
    assert membership(FakeRedis(), db).placed_here(lambda m: m == "a") == ["b"]


def test_the_loop_blocks_only_when_no_models_next_request_is_queued():
    q = ModelQueues()
    assert not q.runnable()
    q.add(Delivery("1-0", item(WorkKind.CREATE_MODEL, 0)))
    assert q.runnable()
    q.take(q.snapshot()[0].pending[0])
    q.add(Delivery("3-0", item(WorkKind.FORWARD, 2)))  # seq 1 missing
    assert not q.runnable()
