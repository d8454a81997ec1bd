"""ModelQueues buffers out-of-order arrivals, drops duplicate deliveries and gives up requests
waiting for a seq_id that never comes."""

from __future__ import annotations

from batcher.policy import plan_round
from batcher.queues import Added, ModelQueues
from core.consumer import Delivery
from core.loss_spec import LossConfig
from core.work import (
    AdamParams,
    CreateModel,
    LoraShape,
    OptimStep,
    PassWork,
    WorkItem,
    WorkKind,
)

_BODIES = {WorkKind.CREATE_MODEL: CreateModel(LoraShape(rank=4)), WorkKind.OPTIM_STEP: OptimStep(AdamParams()),
           WorkKind.FORWARD: PassWork("cross_entropy", LossConfig(), ()),
           WorkKind.FORWARD_BACKWARD: PassWork("cross_entropy", LossConfig(), ())}


def item(seq: int, kind: str = "forward_backward", model: str = "m") -> WorkItem:
    return WorkItem(f"r{seq}", "ten", model, seq, WorkKind(kind), 4, _BODIES[WorkKind(kind)])


def test_out_of_order_items_run_in_seq_order():
    q = ModelQueues()
    q.add(Delivery("0-1", item(0, "create_model")))
    for seq in (3, 2, 1):
        q.add(Delivery(f"0-{seq + 1}", item(seq, "forward" if seq != 2 else "optim_step")))
    order = []
    while True:
        plan = plan_round(q.snapshot())
        if plan.empty:
            break
        for p in (*plan.fused, *plan.barriers):
            q.take(p)
            order.append(p.seq_id)
    assert order == [0, 1, 2, 3]


def test_duplicates_and_already_run_items_are_refused():
    q = ModelQueues()
    assert q.add(Delivery("0-1", item(0, "create_model"))) is Added.QUEUED
    assert q.add(Delivery("0-2", item(0, "create_model"))) is Added.DUPLICATE
    q.take(plan_round(q.snapshot()).barriers[0])
    assert q.add(Delivery("0-3", item(0, "forward"))) is Added.DUPLICATE
    assert q.add(Delivery("0-4", item(1))) is Added.QUEUED
    assert q.add(Delivery("0-5", item(1))) is Added.DUPLICATE


def _started(q: ModelQueues) -> None:
    q.add(Delivery("0-1", item(0, "create_model")), now=0.0)
    q.take(plan_round(q.snapshot()).barriers[0])


def test_requests_behind_a_missing_seq_id_are_given_up_after_the_deadline():
    q = ModelQueues()
    _started(q)
    q.add(Delivery("0-3", item(2)), now=10.0)  # seq_id 1 never comes
    q.add(Delivery("0-4", item(3)), now=20.0)
    assert q.give_up_stalled(60.0, now=69.0) == []  # not yet: the oldest has waited 59 s
    [stalled] = q.give_up_stalled(60.0, now=70.0)
    assert (stalled.model_id, stalled.missing) == ("m", 1)
    assert [d.item.seq_id for d in stalled.given_up] == [2, 3]
    assert q.depth() == 0 and q.arrived == {}
    # The model goes on after them; the missing id, if it comes now, is late (not a silent duplicate).
    assert q.add(Delivery("0-5", item(4)), now=71.0) is Added.QUEUED
    assert [p.seq_id for p in plan_round(q.snapshot()).fused] == [4]
    assert q.add(Delivery("0-6", item(1)), now=72.0) is Added.LATE
    assert q.add(Delivery("0-7", item(2)), now=72.0) is Added.DUPLICATE  # it was queued, then given up


def test_a_model_without_a_gap_is_never_given_up():
    q = ModelQueues()
    _started(q)
    q.add(Delivery("0-2", item(1)), now=0.0)
    q.add(Delivery("0-3", item(2)), now=0.0)
    assert q.give_up_stalled(1.0, now=1e6) == []
    assert q.depth() == 2


def test_giving_up_a_huge_gap_costs_nothing():
    q = ModelQueues()
    _started(q)
    q.add(Delivery("0-2", item(2**31 - 1)), now=0.0)  # a client that skipped two billion ids
    [stalled] = q.give_up_stalled(1.0, now=2.0)
    assert stalled.missing == 1 and sum(len(queued) for _, _, queued in q.given_up["m"]) == 1
    assert q.add(Delivery("0-3", item(12345)), now=3.0) is Added.LATE
    assert q.add(Delivery("0-4", item(2**31 - 1)), now=3.0) is Added.DUPLICATE
