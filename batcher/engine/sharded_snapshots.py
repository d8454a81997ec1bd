"""A trainer gang's snapshots through `torch.distributed.checkpoint`: each rank writes its own shares.

A gang's adapter is split over its ranks (`batcher.engine.grouped.Split`): gathering it to rank 0 for a
snapshot would put the whole adapter and its AdamW moments in one process's memory and one
writer's bandwidth, which LoRA on every expert of a large MoE base (`batcher.engine.expert_lora`; 6.5 B
parameters for Qwen3-235B-A22B at rank 32) makes tens of gigabytes. Here every share is a DTensor
over its layer's tensor-parallel mesh (`Shard(axis)`, the whole shape its global shape) and
`torch.distributed.checkpoint` writes each rank's shares from that rank; a share every rank holds
whole is written once. A reader of any size reshards on load: a gang of another size or split
gives its own DTensors, a single process plain whole tensors (DCP then runs without a process
group).

On disk: DCP's files (`.metadata`, `__<rank>_0.distcp`) and the trainer's `quilt_state.json`,
keyed by the adapter's own layout, `<layer path>.lora_A` ([rank, in], or an experts part's
[E, rank, in]), `.lora_B`, and `moments.<that key>.exp_avg|exp_avg_sq|step` once AdamW has state.
Every rank must see the same directory (one node's disk; a filesystem the nodes share beyond one).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard

from batcher.engine.adapter import Adapter
from batcher.engine.grouped import Split
from batcher.engine.multilora import MultiLoraModel
from checkpoints.layout import TrainerMeta
from core import faults
from core.errors import InvalidInput

MOMENTS = ("exp_avg", "exp_avg_sq")


def is_sharded(directory: str | Path) -> bool:
    """Whether a snapshot directory was written here (else it is a PEFT training checkpoint)."""
    return (Path(directory) / ".metadata").is_file()


def _names(lora: MultiLoraModel, name: str) -> list[str]:
    return [f"{path}.lora_{which}" for path in lora.adapters[name].layers for which in "AB"]


def _shared(t: torch.Tensor, split: Split | None, axis: int | None) -> torch.Tensor:
    """A rank's share as the DTensor of the whole it is part of (a whole tensor as it is)."""
    if split is None or axis is None:
        return t
    shape = list(t.shape)
    shape[axis] *= split.count
    return DTensor.from_local(t.contiguous(), split.mesh, [Shard(axis)], run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def _state(lora: MultiLoraModel, adapter: Adapter, *, moments: bool, fresh: bool) -> dict[str, Any]:
    """The DCP state dict of an adapter: its shares (copies when `fresh`, to load into) and, with
    `moments`, its AdamW state."""
    shares = lora.shares(adapter.name)
    state: dict[str, torch.Tensor] = {}
    for key, p, (split, axis) in zip(_names(lora, adapter.name), adapter.params, shares, strict=True):
        local = torch.zeros_like(p.data) if fresh else p.detach()
        state[key] = _shared(local, split, axis)
        if moments:
            held: Any = None if fresh else adapter.optimizer.state[p]
            for m in MOMENTS:
                state[f"moments.{key}.{m}"] = _shared(torch.zeros_like(p.data) if fresh else held[m], split, axis)
            state[f"moments.{key}.step"] = torch.zeros((), dtype=torch.float32) if fresh else held["step"].clone()
    return state


def save(lora: MultiLoraModel, adapter: Adapter, directory: str) -> int:
    """Write the adapter's snapshot into `directory` from every rank of the gang (a collective: each
    rank calls it with the same directory); rank 0 writes the metadata and publishes it whole by a
    rename. Returns the bytes written (on rank 0; 0 elsewhere)."""
    dest = Path(directory)
    staging = dest.with_name(dest.name + ".partial")  # never a digit-only name: snapshots.latest skips it
    leader = dist.get_rank() == 0
    if leader:
        shutil.rmtree(staging, ignore_errors=True)
    dist.barrier()
    if not leader:
        faults.crash_point("gang.rank_in_snapshot")  # rank 0 is writing its shares, waiting on this rank
    moments = all(p in adapter.optimizer.state for p in adapter.params)
    dcp.save(_state(lora, adapter, moments=moments, fresh=False), checkpoint_id=str(staging))
    if not leader:
        return 0
    TrainerMeta(dict(adapter.lora_config), adapter.steps, adapter.family).write(staging)
    if dest.exists():
        shutil.rmtree(dest)
    staging.rename(dest)
    return sum(f.stat().st_size for f in dest.iterdir())


def load(lora: MultiLoraModel, adapter: Adapter, directory: str,
         new_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> None:
    """Load a sharded snapshot into an existing adapter of the same LoRA shape, resharded to this
    trainer's layout (every rank of a gang calls it; a single process alone)."""
    meta = TrainerMeta.read(directory)
    saved = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    moments = any(key.startswith("moments.") for key in saved)
    state = _state(lora, adapter, moments=moments, fresh=True)
    if set(state) != set(saved):
        missing, extra = sorted(set(state) - set(saved)), sorted(set(saved) - set(state))
        # (a user's kind of error, met alike by every rank of a gang, which stays in step)
        raise InvalidInput(f"snapshot tensors do not match the model: missing {missing[:2]}, extra {extra[:2]}",
                           field="path")
    dcp.load(state, checkpoint_id=directory, no_dist=not dist.is_initialized())
    local = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}
    with torch.no_grad():
        for key, p in zip(_names(lora, adapter.name), adapter.params, strict=True):
            p.copy_(local[key])
    lora.clear_grads(adapter.name)
    lora.changed(adapter.name)
    adapter.optimizer = new_optimizer(adapter.params)
    if moments:
        fused = adapter.optimizer.defaults.get("fused")  # (a fused AdamW keeps its step on the device)
        for key, p in zip(_names(lora, adapter.name), adapter.params, strict=True):
            step = local[f"moments.{key}.step"]
            adapter.optimizer.state[p] = {"step": step.to(p.device) if fused else step,
                                          **{m: local[f"moments.{key}.{m}"] for m in MOMENTS}}
    adapter.steps = meta.steps
