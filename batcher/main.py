"""The trainer process: `python -m batcher.main` (the embedded launcher and the pods run this).

Reads its settings, checks the base fits the device before loading anything, builds the backend
and the worker (batcher.worker), and runs it until SIGTERM or SIGINT.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import torch

from bases import catalog, memory_plan
from batcher import heap
from batcher.engine import gang
from batcher.engine.backend import LoraBackend
from batcher.snapshots import SnapshotStore
from batcher.worker import TrainerWorker
from checkpoints import storage
from core import db, queue, redis_client
from core.settings import (
    TrainerSettings,
    get_api_settings,
    get_core_settings,
    get_gen_pool_settings,
    get_trainer_settings,
)

log = logging.getLogger("quilt.trainer")


def snapshot_store(settings: TrainerSettings) -> SnapshotStore:
    core = get_core_settings()
    root = settings.snapshot_dir or Path(core.data_dir) / "snapshots"
    return SnapshotStore(root, storage.snapshot_store_for(core, root, in_checkpoint_store=settings.snapshots_in_store))


def check_memory(base: catalog.BaseModel, settings: TrainerSettings) -> memory_plan.MemoryPlan:
    """Check, before loading anything, that the base fits this trainer's device; exits naming the
    setting to change when it does not (bases.memory_plan)."""
    gen = get_gen_pool_settings()
    plan = memory_plan.trainer_plan(base.config, settings, gen, max_context=base.max_context_length)
    if plan.trainer_problems:
        raise SystemExit(f"base {base.name!r} does not fit this trainer: " + "; ".join(plan.trainer_problems))
    log.info("memory plan for %s: %s", base.name, ", ".join(f"{k.strip()}={v}" for k, v in plan.rows()[:8]))
    return plan


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    settings = get_trainer_settings()
    if settings.keep_freed_memory:
        heap.keep_freed_memory()
    db_url = db.resolve_url()
    base = catalog.worker_base(db_url, settings.base_model)
    plan = check_memory(base, settings)
    token_budget = settings.token_budget or plan.token_budget
    dtype = getattr(torch, memory_plan.resolve_dtype(settings.dtype, settings.device))
    member = gang.join(gang.GangShape(settings.ranks, settings.parallel), settings.device) \
        if settings.ranks > 1 else None
    backend = LoraBackend(base.path, device=settings.device, max_tokens_per_pass=token_budget,
                          offload_device=settings.offload_device, dtype=dtype,
                          max_resident=settings.max_resident_adapters or plan.resident_adapters, member=member,
                          expert_lora=settings.expert_lora, cuda_graphs=settings.cuda_graphs,
                          graph_limit=settings.cuda_graph_limit, checkpoint_tokens=settings.checkpoint_tokens)
    if member is not None and not member.leader:
        # Rank 0 ends the gang: it finishes its loop on SIGTERM, then tells the others (gang.follow).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        gang.follow(backend, member)
        gang.leave()
        return
    leader = gang.lead(backend, member) if member is not None else None
    shards = get_core_settings().trainer_shards
    # A shard is named by its worker's ordinal: `shard-i` under quilt up, pod quilt-trainer-i on a cluster.
    shard = queue.shard_of(settings.consumer_name, shards) if shards > 1 else None
    if shard and get_core_settings().checkpoint_store == "s3" and not settings.snapshots_in_store:
        log.warning("%d trainer shards with snapshots on this machine's disk only: a shard on another machine "
                    "cannot restore this one's models; set QUILT_TRAINER_SNAPSHOTS_IN_STORE=true", shards)
    worker = TrainerWorker(
        settings, base_model=base.name, backend=backend,
        redis=redis_client.sync_client(), db_url=db_url, result_ttl_s=get_api_settings().future_ttl_seconds,
        token_budget=token_budget, snapshots=snapshot_store(settings) if settings.snapshots else None,
        shard=shard, shards=shards)

    def _stop(signum: int, frame: object) -> None:
        worker.stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    worker.run_forever()
    if leader is not None:
        leader.close()
        gang.leave()
    log.info("trainer stopped")


if __name__ == "__main__":
    main()
