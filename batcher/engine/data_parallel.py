"""An FSDP gang's passes, data parallel: each rank computes its share of a pass's rows.

Under FSDP (`batcher.engine.gang`) every rank holds 1/N of the base and gathers each layer while it
runs, so each rank can compute different tokens. A pass's rows are split so the ranks' token counts
are even (`layout.rank_shares`, a pure function every rank evaluates alike from rank 0's call); each
rank lays out and computes its share, with a token budget per micro-batch of 1/N of the gang's. Every
LoRA is whole on every rank, so the gradients of the pass's models are summed over the ranks after
it (only this pass's part: the other ranks zero their copy of the earlier passes' sum first), and
each rank's optimizer step is then the same step. The datums' results are gathered to every rank,
which answers the requests and decides the kept and discarded gradients as one process would.

FSDP's all-gathers are collectives inside each micro-batch's forward and backward, so every rank
must run as many micro-batches as the busiest rank, each with a backward through every decoder
layer where the pass trains: a rank short of micro-batches runs stand-ins (the pass's shortest row,
keeping no gradient); every micro-batch of a training pass runs with autograd (a forward-only
request's datums keep no gradient, as in a mixed micro-batch of one process); and the input
embeddings' output requires a gradient, so the backward reaches every layer whichever layers the
micro-batch's adapters train.

A request with a datum whose loss is not finite keeps none of its gradient; where another rank
already accumulated some of that request's gradient, the model's accumulated gradients are
discarded and the request's error says so (one process says so only when the bad datum fell in a
later micro-batch).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from batcher.engine import layout
from batcher.engine.device_pass import DevicePass
from batcher.engine.multilora import MultiLoraModel
from batcher.engine.plan import PlannedBatch, Planner, Row
from batcher.engine.protocol import PassRequest
from batcher.engine.results import Datums, PassResult, answers, datum_values
from core.loss_spec import LossConfig

# Gradients are summed in buckets of this many elements: one all-reduce per bucket, not per tensor,
# and no flat copy of every adapter's gradients at once.
_BUCKET = 1 << 24


@dataclasses.dataclass
class DataParallel:
    """This rank's place in a data-parallel gang: `group` carries the results (gloo, host objects);
    the gradients go over the default group (NCCL on GPUs)."""

    rank: int
    size: int
    group: dist.ProcessGroup | None

    def share(self, rows: list[Row]) -> list[Row]:
        """This rank's rows of a pass."""
        return [rows[i] for i in layout.rank_shares([len(r.tokens) for r in rows], self.size)[self.rank]]

    def plan(self, planner: Planner, rows: list[Row], requests: list[PassRequest], configs: dict[int, LossConfig]
             ) -> tuple[list[PlannedBatch], int]:
        """This rank's micro-batches, then stand-ins up to the busiest rank's count (`batcher.engine.plan`);
        and how many are its own (the stand-ins come last, their values are not read)."""
        shares = layout.rank_shares([len(r.tokens) for r in rows], self.size)
        counts = [len(planner.layouts([rows[i] for i in share])) for share in shares]
        batches = planner.plan([rows[i] for i in shares[self.rank]], requests, configs)
        own = len(batches)
        if own < max(counts):
            shortest = min(rows, key=lambda r: len(r.tokens))
            idle = [dataclasses.replace(r, forward_only=True) for r in requests]
            [stand_in] = planner.plan([shortest], idle, configs)
            batches += [stand_in] * (max(counts) - own)
        trains = any(not r.forward_only for r in requests)
        for batch in batches:
            batch.trains = trains  # the same backward on every rank, micro-batch by micro-batch
        return batches, own

    def gather(self, per_datum: Datums, kept: set[int]) -> tuple[Datums, set[int]]:
        """Every rank's datums' results and kept requests, on every rank."""
        parts: list[Any] = [None] * self.size
        dist.all_gather_object(parts, (per_datum, kept), group=self.group)
        merged: Datums = {i: {} for i in per_datum}
        every: set[int] = set()
        for theirs, their_kept in parts:
            for i, by_datum in theirs.items():
                merged[i].update(by_datum)
            every |= their_kept
        return merged, every

    def run(self, planner: Planner, device_pass: DevicePass, lora: MultiLoraModel, names: list[str], rows: list[Row],
            requests: list[PassRequest], configs: dict[int, LossConfig]) -> tuple[PassResult, list[PlannedBatch]]:
        """A pass of the gang on this rank: its share of the rows, the gradients of the adapters
        `names` summed over the ranks, every rank's results gathered; (the pass's result, this
        rank's own micro-batches). A failure breaks the gang."""
        self.keep_only_rank0_sums(lora, names)
        batches, own = self.plan(planner, rows, requests, configs)
        values = device_pass.compute(batches, len(requests)).cpu()
        self.sum_grads(lora, names)
        per_datum, kept = self.gather(*datum_values(batches[:own], values, configs))
        return answers(per_datum, kept, requests, configs), batches[:own]

    def keep_only_rank0_sums(self, lora: MultiLoraModel, names: list[str]) -> None:
        """Before a pass: the ranks other than 0 zero these adapters' accumulated gradients, so the
        sum after it counts the earlier passes' once (every rank holds that sum)."""
        if self.rank != 0:
            grads = [g for name in names for g in lora.grad_rows(name)]
            if grads:
                torch._foreach_zero_(grads)

    def sum_grads(self, lora: MultiLoraModel, names: list[str]) -> None:
        """After a pass: these adapters' gradient rows summed over the ranks, in place."""
        grads = [g for name in names for g in lora.grad_rows(name)]
        for bucket in _buckets(grads):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat)
            at = 0
            for g in bucket:
                g.copy_(flat[at:at + g.numel()].view_as(g))
                at += g.numel()


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    out: list[list[torch.Tensor]] = [[]]
    size = 0
    for t in tensors:
        if out[-1] and size + t.numel() > _BUCKET:
            out.append([])
            size = 0
        out[-1].append(t)
        size += t.numel()
    return [b for b in out if b]


def backward_through_every_layer(base: Any) -> None:
    """Make the input embeddings' output require a gradient while autograd records: a training
    micro-batch's backward then runs through every decoder layer, and with it FSDP's all-gathers,
    on every rank alike."""
    embeddings: nn.Module = base.get_input_embeddings()

    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        return output.detach().requires_grad_() if torch.is_grad_enabled() else None

    embeddings.register_forward_hook(hook)
