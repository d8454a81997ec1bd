"""Durable training state: one snapshot per training model, plus the stream as the replay log.

A model's state is its adapter weights, its AdamW state and its step count at some `seq_id`,
plus the gradients of the requests after it. The trainer writes a snapshot after a model's
create, load and every `QUILT_TRAINER_SNAPSHOT_EVERY_STEPS`-th optimizer step, and keeps every
stream entry of the model unacknowledged until a snapshot covers it: a restarted trainer loads
each model's newest snapshot and re-runs the entries after it in seq_id order (those already
answered are re-run for their effect only: no second result, no second charge, see
`core.consumer.Delivery.finished`). So no step a client could have seen is lost. The entries live
in Redis with append-only persistence (`core.embedded`).

On disk: `<root>/<model_id>/<seq_id, 10 digits>/`, a training checkpoint directory
(`checkpoints.layout`), or for a trainer gang each rank's shares through
torch.distributed.checkpoint (`batcher.engine.sharded_snapshots`), which a trainer of any size reads;
each is written beside the others, then older ones are removed, so a crash at any point leaves at
least one whole snapshot. Where they live is a store
(`checkpoints.storage.snapshot_store_for`): this machine's disk, or with
QUILT_TRAINER_SNAPSHOTS_IN_STORE and the S3 checkpoint store also the bucket: a snapshot is
uploaded before `write` returns (so before the requests it covers are acknowledged), and a trainer
on another machine finds and fetches a model's newest one.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from batcher.engine.protocol import TrainerBackend
from checkpoints.layout import TrainerMeta
from checkpoints.storage import LocalStore
from core.work import LoraShape

log = logging.getLogger("quilt.trainer")


class SnapshotStore:
    def __init__(self, root: str | Path, store: LocalStore | None = None):
        self.root = Path(root)
        self.store = store or LocalStore(self.root)

    def _dir(self, model_id: str) -> Path:
        return self.root / model_id.replace("/", "_")

    def write(self, backend: TrainerBackend, model_id: str, seq_id: int) -> int:
        """Snapshot the model's state as of `seq_id` (no gradients pending); returns bytes written."""
        directory = self._dir(model_id)
        path = directory / f"{seq_id:010d}"
        size = backend.snapshot(model_id, str(path))
        self.store.publish(str(path))
        for old in self.store.children(directory):
            if old.isdigit() and int(old) < seq_id:
                self.store.remove(str(directory / old))
        return size

    def latest(self, model_id: str) -> tuple[int, Path] | None:
        directory = self._dir(model_id)
        done = sorted(int(name) for name in self.store.children(directory) if name.isdigit())
        return (done[-1], directory / f"{done[-1]:010d}") if done else None

    def restore(self, backend: TrainerBackend, model_id: str) -> int | None:
        """Load the model's newest snapshot into the backend; returns its seq_id (None: no snapshot,
        or one that could not be loaded, which is logged and leaves nothing of the model behind)."""
        found = self.latest(model_id)
        if found is None:
            return None
        seq_id, path = found
        try:
            path = self.store.fetch(str(path))  # from the bucket when this machine has not got it
            meta = TrainerMeta.read(path)
            backend.create(model_id, LoraShape.from_json(meta.lora_config), meta.optimizer)
            backend.load_snapshot(model_id, str(path))
        except Exception:
            log.exception("snapshot of %s could not be loaded", model_id)
            backend.delete(model_id)
            return None
        return seq_id

    def drop(self, model_id: str) -> None:
        directory = self._dir(model_id)
        for name in self.store.children(directory):
            self.store.remove(str(directory / name))
        shutil.rmtree(directory, ignore_errors=True)
