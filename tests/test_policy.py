"""Round planning is a pure function: tables of queue states in, plans out."""

from __future__ import annotations

from batcher.policy import ModelQueue, Pending, plan_round, runnable_prefix


def p(model: str, seq: int, kind: str = "forward_backward") -> Pending:
    return Pending(f"{model}-{seq}", model, "ten", seq, kind, 10)


def test_waits_for_the_missing_seq():
    q = ModelQueue("m", 1, (p("m", 2), p("m", 3)))
    assert runnable_prefix(q) == ()


def test_consecutive_forward_requests_run_together_until_a_barrier():
    q = ModelQueue("m", 1, (p("m", 1), p("m", 2, "forward"), p("m", 3, "optim_step"), p("m", 4)))
    assert [x.seq_id for x in runnable_prefix(q)] == [1, 2]


def test_a_barrier_at_the_head_runs_alone():
    q = ModelQueue("m", 3, (p("m", 3, "optim_step"), p("m", 4)))
    assert [x.seq_id for x in runnable_prefix(q)] == [3]


def test_round_fuses_models_and_keeps_barriers_per_model():
    plan = plan_round([
        ModelQueue("a", 1, (p("a", 1), p("a", 2, "optim_step"))),
        ModelQueue("b", 5, (p("b", 5, "save_weights"), p("b", 6))),
        ModelQueue("c", 0, (p("c", 0, "create_model"),)),
        ModelQueue("d", 2, (p("d", 3),)),
    ])
    assert [x.request_id for x in plan.fused] == ["a-1"]
    assert [x.request_id for x in plan.barriers] == ["b-5", "c-0"]


def test_empty_queues_plan_nothing():
    assert plan_round([]).empty
