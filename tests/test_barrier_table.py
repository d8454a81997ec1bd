"""The barrier table (batcher.barriers) against a recording backend: one handler per kind, and the
ordering rule, stated once in `begin_round`: a barrier that changes a model's weights in place waits
until that model's exports already started are written."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from batcher.barriers import Barriers
from checkpoints.storage import LocalStore
from core.errors import UserError
from core.work import LoadWeights, SaveWeights, WorkItem, WorkKind
from tests.test_trainer_rules import item as any_item

NOT_BARRIERS = {WorkKind.FORWARD, WorkKind.FORWARD_BACKWARD, WorkKind.SAMPLE}  # the pass's; the sampler's


class _Backend:
    """Records what the table asks of it; an export's write waits for `release`."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.release = threading.Event()

    def export(self, model_id, directory, *, overwrite, with_optimizer=True):
        self.log.append(f"export {model_id}")

        def write() -> int:
            self.release.wait(10)
            Path(directory).mkdir(parents=True, exist_ok=True)
            self.log.append(f"written {model_id}")
            return 1

        return write

    def policy_version(self, model_id):
        return 0

    def optim_steps(self, steps):
        self.log.append("steps " + ",".join(model_id for model_id, _ in steps))
        return [{"metrics": {}} for _ in steps]

    def optim_step(self, model_id, adam):
        self.log.append(f"step {model_id}")
        return {"metrics": {}}

    def load(self, model_id, directory, *, optimizer):
        self.log.append(f"load {model_id}")


@pytest.fixture()
def item(tmp_path):
    """Work items whose files lie under this test's directory."""
    (tmp_path / "loaded").mkdir()

    def make(kind: WorkKind, seq: int = 1, model: str = "m", request: str | None = None) -> WorkItem:
        base = any_item(kind, seq, model, request)
        if kind in (WorkKind.SAVE_WEIGHTS, WorkKind.SAVE_WEIGHTS_FOR_SAMPLER):
            return WorkItem(base.request_id, base.tenant_id, model, seq, kind, 4,
                            SaveWeights("s", str(tmp_path / "saved" / model / str(seq)), overwrite=True))
        if kind is WorkKind.LOAD_WEIGHTS:
            return WorkItem(base.request_id, base.tenant_id, model, seq, kind, 4,
                            LoadWeights(str(tmp_path / "loaded"), True, "tinker://m/weights/a"))
        return base

    return make


@pytest.fixture()
def table(tmp_path):
    log: list[str] = []
    backend = _Backend(log)
    barriers = Barriers(backend=backend, store=LocalStore(tmp_path), snapshots=None,
                        db_call=lambda record, *a, **kw: False)
    yield barriers, backend, log
    backend.release.set()
    barriers.exports.close()


def test_every_kind_but_the_fused_pass_has_a_handler():
    barriers = Barriers(backend=None, store=None, snapshots=None, db_call=None)
    assert set(barriers._handlers) == set(WorkKind) - NOT_BARRIERS
    assert {k for k, h in barriers._handlers.items() if h.changes_weights} == {WorkKind.OPTIM_STEP,
                                                                               WorkKind.LOAD_WEIGHTS}


@pytest.mark.parametrize("kind", [WorkKind.OPTIM_STEP, WorkKind.LOAD_WEIGHTS])
def test_a_weight_change_waits_for_its_models_exports(table, item, kind):
    barriers, backend, log = table
    assert barriers.run(item(WorkKind.SAVE_WEIGHTS_FOR_SAMPLER, 1, "m"), "ctx-save") is None  # answered later
    threading.Timer(0.2, backend.release.set).start()
    done = barriers.begin_round([item(kind, 2, "m", "r2")])
    assert [ctx for ctx, _ in done] == ["ctx-save"] and isinstance(done[0][1], dict)
    barriers.run(item(kind, 2, "m", "r2"))
    changed = "steps m" if kind is WorkKind.OPTIM_STEP else "load m"
    assert log == ["export m", "written m", changed]


def test_other_barriers_and_other_models_do_not_wait(table, item):
    barriers, backend, log = table
    barriers.run(item(WorkKind.SAVE_WEIGHTS_FOR_SAMPLER, 1, "m"), "ctx")
    done = barriers.begin_round([item(WorkKind.OPTIM_STEP, 1, "n", "rn"), item(WorkKind.SAVE_WEIGHTS, 2, "k", "rk")])
    assert done == [] and log == ["export m", "steps n"]  # m's export is still being written
    assert barriers.run(item(WorkKind.OPTIM_STEP, 1, "n", "rn")) == {"metrics": {}}
    backend.release.set()
    barriers.exports.wait_for()
    assert [ctx for ctx, _ in barriers.finished_exports()] == ["ctx"]


def test_a_rounds_steps_are_taken_together_and_one_outside_a_round_alone(table, item):
    barriers, _, log = table
    barriers.begin_round([item(WorkKind.OPTIM_STEP, 1, "a", "ra"), item(WorkKind.OPTIM_STEP, 1, "b", "rb")])
    barriers.run(item(WorkKind.OPTIM_STEP, 1, "a", "ra"))
    barriers.run(item(WorkKind.OPTIM_STEP, 1, "b", "rb"))
    barriers.run(item(WorkKind.OPTIM_STEP, 2, "a", "ra2"))
    assert log == ["steps a,b", "step a"]


def test_a_handlers_failure_is_its_requests_typed_error(table, item):
    barriers, _, _ = table
    outcome = barriers.run(item(WorkKind.REJECTED))
    assert isinstance(outcome, UserError) and outcome.field == "seq_id"
