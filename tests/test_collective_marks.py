"""Every backend call a gang's ranks must all make is marked where it is defined, and only those are
handed to the other ranks (batcher.engine.collective): a tensor-changing method left unmarked would
hang every gang in its next collective, and this is the test that fails first."""

from __future__ import annotations

import inspect

import pytest

from batcher.engine import gang
from batcher.engine.backend import LOCAL_CALLS, LoraBackend
from batcher.engine.collective import collective, collective_calls, unmarked
from batcher.engine.protocol import TrainerBackend
from core.errors import InvalidInput
from core.work import LoraShape


def test_every_public_backend_method_is_marked_or_declared_local():
    assert unmarked(LoraBackend, LOCAL_CALLS) == []
    assert not set(collective_calls(LoraBackend)) & LOCAL_CALLS
    assert LOCAL_CALLS <= {name for name, _ in inspect.getmembers(LoraBackend, inspect.isfunction)}


def test_the_check_fails_when_a_collective_method_loses_its_marker():
    class Careless(LoraBackend):
        def run_pass(self, requests):  # an override without @collective()
            return super().run_pass(requests)

        def reshard(self, model_id: str) -> None:  # a new method, neither marked nor local
            pass

    assert unmarked(Careless, LOCAL_CALLS) == ["reshard", "run_pass"]


def test_the_protocol_the_loop_calls_is_all_marked_or_local():
    names = {name for name, _ in inspect.getmembers(TrainerBackend, inspect.isfunction) if not name.startswith("_")}
    assert names <= set(collective_calls(LoraBackend)) | LOCAL_CALLS
    assert {"run_pass", "optim_steps", "create", "export", "load_saved", "snapshot"} <= set(collective_calls(LoraBackend))


def test_a_save_is_export_on_the_other_ranks():
    calls = collective_calls(LoraBackend)
    assert calls["save"] == "export"
    assert all(follower == name for name, follower in calls.items() if name != "save")


class _Toy:
    """A backend in miniature: two marked calls, one inside the other, and a local read."""

    def __init__(self) -> None:
        self.mirror = None
        self.log: list[str] = []

    @collective()
    def step(self, n: int) -> int:
        self.log.append(f"step {n}")
        return self.inner(n) + 1

    @collective()
    def inner(self, n: int) -> int:
        self.log.append(f"inner {n}")
        return n

    @collective()
    def fail(self, user: bool) -> None:
        raise InvalidInput("no", field="x") if user else RuntimeError("device fault")

    def read(self) -> int:
        return len(self.log)


def test_rank_0_hands_on_each_outermost_marked_call_once_before_making_it():
    toy, sent = _Toy(), []
    toy.mirror = gang.Leader(member=None, send=lambda message: sent.append((message, list(toy.log))))
    assert toy.step(3) == 4 and toy.read() == 2
    # step went out before rank 0 ran it; inner is part of step, not handed on again
    assert sent == [(("step", (3,), {}), [])]
    toy.inner(5)
    assert [m for m, _ in sent] == [("step", (3,), {}), ("inner", (5,), {})]


def test_a_server_failure_on_rank_0_breaks_the_gang_and_a_user_one_does_not():
    toy, sent = _Toy(), []
    toy.mirror = gang.Leader(member=None, send=sent.append)
    with pytest.raises(InvalidInput):
        toy.fail(True)
    with pytest.raises(gang.GangBroken, match="fail failed on rank 0: RuntimeError: device fault"):
        toy.fail(False)
    assert toy.step(1) == 2  # the leader is not left inside a call
    assert len(sent) == 3


def test_rank_0_decides_what_each_rank_would_leave_to_chance():
    sent = []
    leader = gang.Leader(member=None, send=sent.append)
    ran = []
    leader.call("create", lambda *a, **kw: ran.append((a, kw)), ("m", LoraShape(rank=4)), {})
    [(name, (model_id, lora), _)] = sent
    assert name == "create" and lora.seed is not None and ran[0][0][1].seed == lora.seed
    leader.call("offload_idle", lambda *a, **kw: ran.append((a, kw)), (60.0,), {})
    assert sent[1][2]["now"] == ran[1][1]["now"] is not None
    # The optimizer family the trainer passes along is handed on as given (a gang's create failed on it).
    leader.call("create", lambda *a, **kw: ran.append((a, kw)), ("n", LoraShape(rank=4, seed=3), "adamw"), {})
    assert sent[2][1] == ("n", LoraShape(rank=4, seed=3), "adamw") == ran[2][0]


def test_a_follower_makes_the_named_call(monkeypatch):
    toy = _Toy()
    messages = iter([("step", (2,), {}), ("fail", (True,), {}), None])

    def receive(box, src, group):
        box[0] = next(messages)

    monkeypatch.setattr(gang.dist, "broadcast_object_list", receive)
    gang.follow(toy, gang.Member(rank=1, size=2, shape=gang.GangShape(2), control=None))
    assert toy.log == ["step 2", "inner 2"]  # and the user error was met as on rank 0, not raised
