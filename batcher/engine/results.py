"""A fused pass's results on the host: from the one tensor it read back to each request's answer.

Per micro-batch the device writes, in order: each datum's loss, mismatch KL and |lp - slp| sums
(D each), whether each request kept its gradient (R), then every position's target logprobs and
elementwise loss (M x K each).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from batcher.engine import losses
from batcher.engine.plan import PlannedBatch
from batcher.engine.protocol import PassRequest
from core.loss_spec import LossConfig


@dataclass
class PassResult:
    """Each admitted request's answer, by its index in the pass: its Tinker ForwardBackwardOutput, or
    the datums whose loss was not finite and whether some of its gradient was accumulated already;
    and the models whose gradients the pass kept."""

    outputs: dict[int, dict[str, Any]] = field(default_factory=dict)
    not_finite: dict[int, tuple[list[int], bool]] = field(default_factory=dict)
    kept_models: set[str] = field(default_factory=set)


def read_back(batches: list[PlannedBatch], values: torch.Tensor, requests: list[PassRequest],
              configs: dict[int, LossConfig]) -> PassResult:
    """Results, errors and kept gradients from the values the pass read back."""
    return answers(*datum_values(batches, values, configs), requests, configs)


Datums = dict[int, dict[int, losses.DatumLoss]]  # each admitted request's datums' losses, by datum index


def datum_values(batches: list[PlannedBatch], values: torch.Tensor, configs: dict[int, LossConfig]
                 ) -> tuple[Datums, set[int]]:
    """Each datum's loss and outputs from the values these micro-batches read back (values past
    theirs are ignored), and the requests whose gradient some micro-batch accumulated."""
    per_datum: Datums = {i: {} for i in configs}
    kept: set[int] = set()
    at = 0
    for batch in batches:
        at = _batch_values(batch, values, at, per_datum, kept)
    return per_datum, kept


def answers(per_datum: Datums, kept: set[int], requests: list[PassRequest], configs: dict[int, LossConfig]
            ) -> PassResult:
    """Each request's answer from all its datums (a data-parallel gang's, gathered from its ranks)."""
    not_finite: dict[int, list[int]] = {}
    for i, by_datum in per_datum.items():
        bad = sorted(j for j, d in by_datum.items() if not math.isfinite(d.metrics["loss:sum"]))
        if bad:
            not_finite[i] = bad
    result = PassResult()
    for i in configs:
        if i in not_finite:
            result.not_finite[i] = (not_finite[i], i in kept)
        else:
            result.outputs[i] = _forward_backward_output([per_datum[i][j] for j in sorted(per_datum[i])])
    discarded = {requests[i].model_id for i in not_finite if i in kept}
    result.kept_models = {requests[i].model_id for i in kept} - discarded
    return result


def _batch_values(batch: PlannedBatch, values: torch.Tensor, at: int,
                  per_datum: dict[int, dict[int, losses.DatumLoss]], kept: set[int]) -> int:
    """One micro-batch's datums from `values[at:]`; returns where the next micro-batch's begin. A
    custom loss's datum reports its own metrics and its logprobs (it has no elementwise loss)."""
    D, R = batch.plan.size, batch.requests_size
    M, K = batch.plan.tensors.datum.shape[0], batch.plan.width
    loss, kl, abs_diff = (values[at + j * D:at + (j + 1) * D].tolist() for j in range(3))
    keep = values[at + 3 * D:at + 3 * D + R].tolist()
    at += 3 * D + R
    lp = values[at:at + M * K].view(M, K).float()
    elementwise = values[at + M * K:at + 2 * M * K].view(M, K).float()
    at += 2 * M * K
    kept |= {row.request_index for row in batch.rows if keep[row.request_index]}
    custom = {c.datum: c for c in batch.custom}
    offset = 0
    for k, (row, datum) in enumerate(zip(batch.rows, batch.plan.metrics(loss, kl, abs_diff))):
        n = len(row.tokens)
        sl = slice(offset, offset + n)
        offset += n
        shape = (n, row.width) if row.width > 1 else (n,)
        datum.outputs = {"logprobs": lp[sl, :row.width].reshape(shape)}
        if k in custom:
            keys = list(custom[k].graph.metrics)
            datum.metrics.update(zip(keys, values[at:at + len(keys)].tolist()))
            at += len(keys)
        else:
            datum.outputs["elementwise_loss"] = elementwise[sl, :row.width].reshape(shape)
        per_datum[row.request_index][row.datum_index] = datum
    return at


def _forward_backward_output(per_datum: list[losses.DatumLoss]) -> dict[str, Any]:
    outputs = []
    for d in per_datum:
        outputs.append({
            key: {"data": t.detach().float().cpu().flatten().tolist(), "dtype": "float32", "shape": list(t.shape)}
            for key, t in d.outputs.items()
        })
    return {"loss_fn_output_type": "ArrayRecord", "loss_fn_outputs": outputs,
            "metrics": losses.reduce_metrics(per_datum)}
