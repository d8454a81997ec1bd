"""The barrier table: everything but the fused pass, one model's request alone, kind -> handler.

Each handler returns the request's outcome (a result dict, or its typed error); none finishes a
request: the worker answers, keeps or acknowledges the stream entry. Sampler weights are written
off the loop (batcher.exports): their handler takes what is to be written and returns None, and
`finished_exports` hands back the outcomes of the saves written since, oldest first.

The ordering rule, kept here once (`begin_round`): a barrier that changes its model's weights in
place (an optimizer step, a load) waits until every export of that model already started is
written, since an export writes the optimizer state it took by reference. A round holds at most one
barrier per model (batcher.policy), so waiting at the start of the round is waiting before it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batcher.engine.protocol import Outcome, TrainerBackend
from batcher.exports import Exports
from batcher.snapshots import SnapshotStore
from checkpoints import encryption
from checkpoints import records as checkpoint_records
from checkpoints.layout import EXTERNAL_KIND, SAMPLER_KIND, TRAINING_KIND
from checkpoints.storage import LocalStore
from core import faults, ids, records
from core.errors import Conflict, QuiltError, ServerError, UserError
from core.settings import get_core_settings
from core.work import (
    CreateModel,
    LoadWeights,
    OptimStep,
    Rejected,
    SaveWeights,
    WorkItem,
    WorkKind,
)

log = logging.getLogger("quilt.trainer")


@dataclass(frozen=True)
class Handler:
    """How one kind of barrier runs: `run(item, context)` gives its outcome, or None when it is
    answered later (with `context`, from `finished_exports`); `changes_weights`: it changes its
    model's weights in place, so it waits for the model's exports (the ordering rule)."""

    run: Callable[[WorkItem, Any], Outcome | None]
    changes_weights: bool = False

_CHECKPOINT_KINDS = {WorkKind.SAVE_WEIGHTS: TRAINING_KIND, WorkKind.SAVE_WEIGHTS_FOR_SAMPLER: SAMPLER_KIND,
                     WorkKind.SAVE_WEIGHTS_EXTERNAL: EXTERNAL_KIND}



def as_error(item: WorkItem, exc: Exception) -> QuiltError:
    """A barrier's failure as the request's typed error (unexpected ones are logged, and are ours)."""
    if isinstance(exc, QuiltError):
        return exc
    log.exception("%s failed for %s", item.kind, item.model_id)
    return ServerError(f"{item.kind} failed: {type(exc).__name__}: {exc}")


class Barriers:
    def __init__(self, *, backend: TrainerBackend, store: LocalStore, snapshots: SnapshotStore | None,
                 db_call: Callable[..., Any]):
        self.backend = backend
        self.store = store  # where checkpoints are written and read from (checkpoints.storage)
        self.snapshots = snapshots
        self.db_call = db_call  # db_call(record, *args): a records-style call that waits out a Postgres restart
        self.exports = Exports()  # sampler weights being written off the loop
        self._stepped: dict[str, Outcome] = {}  # this round's optimizer steps, taken together
        self._handlers: dict[WorkKind, Handler] = {
            WorkKind.CREATE_MODEL: Handler(self._create),
            WorkKind.OPTIM_STEP: Handler(self._optim_step, changes_weights=True),
            WorkKind.SAVE_WEIGHTS: Handler(self._save),
            WorkKind.SAVE_WEIGHTS_EXTERNAL: Handler(self._save),
            WorkKind.SAVE_WEIGHTS_FOR_SAMPLER: Handler(self._start_export),
            WorkKind.LOAD_WEIGHTS: Handler(self._load, changes_weights=True),
            WorkKind.REJECTED: Handler(self._rejected),
        }

    def begin_round(self, items: list[WorkItem]) -> list[tuple[Any, Outcome]]:
        """Before a round's barriers run (distinct models): the ordering rule, then the round's
        optimizer steps taken together (`TrainerBackend.optim_steps`). Returns the exports that
        were written meanwhile, to be answered first (context, outcome)."""
        waited = False
        for item in items:
            if self._handlers[item.kind].changes_weights:
                self.exports.wait_for(item.model_id)
                waited = True
        done = self.finished_exports() if waited else []
        self._stepped = self._optim_steps([item for item in items if item.kind is WorkKind.OPTIM_STEP])
        return done

    def run(self, item: WorkItem, context: Any = None) -> Outcome | None:
        """Run the barrier `item`; its result, or its typed error; None for a save answered once
        written (`finished_exports` gives it back with `context`)."""
        try:
            return self._handlers[item.kind].run(item, context)
        except Exception as exc:
            return as_error(item, exc)

    def _optim_steps(self, items: list[WorkItem]) -> dict[str, Outcome]:
        """The optimizer steps of a round, taken together: each request's outcome by request id."""
        if not items:
            return {}
        try:
            outcomes = self.backend.optim_steps([(item.model_id, item.body_as(OptimStep).params) for item in items])
        except Exception as exc:
            return {item.request_id: as_error(item, exc) for item in items}
        return {item.request_id: outcome for item, outcome in zip(items, outcomes)}

    def finished_exports(self) -> list[tuple[Any, Outcome]]:
        """(context, outcome) of each export written (or failed) since the last call, oldest first."""
        out: list[tuple[Any, Outcome]] = []
        for export in self.exports.finished():
            item, context, result = export.context
            outcome: Outcome
            try:
                outcome = self._saved(item, export.future.result(), result)
            except Exception as exc:
                outcome = as_error(item, exc)
            out.append((context, outcome))
        return out

    # ------------------------------------------------------------------ handlers

    def _start_export(self, item: WorkItem, context: Any) -> None:
        """Sampler weights (the adapter alone, tagged with the policy version they were taken at):
        checked and taken now, written by the export thread; its outcome comes back with `context`
        from `finished_exports`. An error now is the request's outcome at once."""
        write, result = self._save_job(item)

        def written() -> int:
            faults.crash_point("trainer.during_export")
            return write()

        self.exports.start(item.model_id, written, (item, context, result))
        return None

    def _create(self, item: WorkItem, context: Any = None) -> dict[str, Any]:
        work = item.body_as(CreateModel)
        try:
            self.backend.create(item.model_id, work.lora, work.optimizer)
            if work.load:  # create-from-checkpoint: the model's first request also loads its state
                self.backend.load(item.model_id, str(self.store.fetch(work.load.storage_path)),
                                  optimizer=work.load.optimizer)
            self.db_call(records.set_model_status, item.model_id, "ready")
        except Exception as exc:
            err = as_error(item, exc)
            self.backend.delete(item.model_id)
            if self.snapshots is not None:
                self.snapshots.drop(item.model_id)
            self.db_call(records.set_model_status, item.model_id, "failed", err.message)
            raise err from exc
        if work.load:
            return {"type": "load_weights", "model_id": item.model_id, "path": work.load.path}
        return {"type": "create_model", "model_id": item.model_id}

    def _optim_step(self, item: WorkItem, context: Any = None) -> Outcome:
        """Its share of the round's steps (`begin_round`); alone when the round did not take it."""
        taken = self._stepped.pop(item.request_id, None)
        if taken is not None:
            return taken
        work = item.body_as(OptimStep)
        return self.backend.optim_step(item.model_id, work.params)

    def _load(self, item: WorkItem, context: Any = None) -> dict[str, Any]:
        work = item.body_as(LoadWeights)
        self.backend.load(item.model_id, str(self.store.fetch(work.storage_path)), optimizer=work.optimizer)
        return {"type": "load_weights", "path": work.path, "model_id": item.model_id}

    @staticmethod
    def _rejected(item: WorkItem, context: Any = None) -> dict[str, Any]:
        work = item.body_as(Rejected)  # fails in its place in the order (api.seq_gaps)
        raise UserError(work.error, field=work.field)

    def _save(self, item: WorkItem, context: Any = None) -> dict[str, Any]:
        """A training checkpoint (weights and optimizer state) or an export for download (the
        adapter alone), written here, in the loop."""
        write, result = self._save_job(item)
        return self._saved(item, write(), result)

    def _save_job(self, item: WorkItem) -> tuple[Callable[[], int], dict[str, Any]]:
        """What a save writes (TrainerBackend.export) and the answer it will give."""
        work = item.body_as(SaveWeights)
        kind = _CHECKPOINT_KINDS[item.kind]
        # Every save gets a new directory (checkpoints.layout), so "exists" is a question for the records.
        if not work.overwrite and self.db_call(checkpoint_records.checkpoint_exists, item.model_id, kind, work.name):
            raise Conflict(f"checkpoint {work.name!r} already exists; pass overwrite=True to replace it", field="path")
        write_files = self.backend.export(item.model_id, str(self.store.local_dir(work.storage_path)),
                                          overwrite=work.overwrite, with_optimizer=item.kind is WorkKind.SAVE_WEIGHTS)

        def write() -> int:  # a save is answered only once it is in the store
            size = write_files()
            if work.age_recipients:  # encrypted before it is published: no plain copy ever leaves here
                size = encryption.encrypt_directory(Path(self.store.local_dir(work.storage_path)), work.age_recipients)
            self.store.publish(work.storage_path)
            return size

        result: dict[str, Any] = {"type": str(item.kind), "path": ids.tinker_path(item.model_id, kind, work.name)}
        if item.kind is WorkKind.SAVE_WEIGHTS_FOR_SAMPLER:
            result["policy_version"] = self.backend.policy_version(item.model_id)
            if work.sampling_session_id:
                result["sampling_session_id"] = work.sampling_session_id
        return write, result

    def _saved(self, item: WorkItem, size: int, result: dict[str, Any]) -> dict[str, Any]:
        """Record a written checkpoint; returns the save's answer."""
        work = item.body_as(SaveWeights)
        self.db_call(checkpoint_records.upsert_checkpoint, tenant_id=item.tenant_id, model_id=item.model_id,
                     kind=_CHECKPOINT_KINDS[item.kind], name=work.name, storage_path=work.storage_path,
                     size_bytes=size, ttl_s=work.ttl_s, sliding=work.sliding,
                     grace_s=get_core_settings().superseded_version_grace_s, user_metadata=work.user_metadata)
        return result
