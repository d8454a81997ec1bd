"""Per-step metrics of a training run: what the trainer and clients record for its curves.

The trainer adds one row per completed `forward_backward`, inside the transaction that finishes the
request (`billing.ledger.settle`), so a redelivered request never adds a second row. Clients add
their own named scalars (RL rewards, evals) through `POST /api/v1/quilt/models/{model_id}/metrics`.
A row's `step` is the model's policy version (optimizer steps taken) when its data was computed, so
trainer and client rows of one training step line up on one x-axis.

Reads are tenant-scoped and live with the other scoped reads (`tenancy.scoped.list_run_metrics`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import DictRow
from psycopg.types.json import Jsonb

from core import numbers
from core.errors import InvalidInput
from core.work import Datum

TRAINER = "trainer"
CLIENT = "client"

MAX_NAMES = 64  # metric names in one client post
MAX_NAME_CHARS = 64
MAX_STEP = 2**31 - 1  # the column is an integer
_NAME = re.compile(r"[\w.:/-]+")  # what the cookbook's names use ('env/all/reward_mean'); no markup

# The trainer's loss per weighted token (Σ loss / Σ weights), the number people plot. `loss:sum`
# depends on the batch size, so curves of runs with different batches would not compare.
LOSS_PER_TOKEN = "loss:mean"


@dataclass(frozen=True)
class StepMetrics:
    """One row's content: the step (policy version) and metric name -> value (None: not finite)."""

    step: int
    values: Mapping[str, float | None]


def trainer_values(data: Sequence[Datum], result_metrics: dict[str, float]) -> dict[str, float | None]:
    """What a finished forward_backward adds to its run's curves: the request's reduced metrics
    (`loss:sum`, staleness, trainer-sampler mismatch, ...) plus `loss:mean`, the loss per weighted
    token: `loss:sum` over the sum of the `weights` input (over the target tokens where a datum has
    no weights).

    Non-finite values become None: JSON (and jsonb) has no NaN, and a diverging run must still
    finish its requests."""
    weight = 0.0
    for datum in data:
        inputs = datum.inputs
        weights = inputs.get("weights")
        weight += float(sum(weights)) if weights is not None else float(len(inputs["target_tokens"]))
    values = dict(result_metrics)
    if weight > 0 and "loss:sum" in values:
        values[LOSS_PER_TOKEN] = values["loss:sum"] / weight
    return {k: (float(v) if math.isfinite(v) else None) for k, v in values.items()}


def check_step(step: Any) -> int:
    """A client's `step`: an integer in [0, 2^31)."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise InvalidInput(f"step must be an integer in [0, {MAX_STEP}], got {step!r}", field="step")
    return step


def check_client_metrics(metrics: Any) -> dict[str, float]:
    """A client's metrics: 1 to 64 names of at most 64 word characters (and `. : / -`), each a
    finite number. Each error names the field and the limit it broke."""
    if not isinstance(metrics, dict) or not metrics:
        raise InvalidInput("metrics must be a non-empty object of name -> number", field="metrics")
    if len(metrics) > MAX_NAMES:
        raise InvalidInput(f"metrics has {len(metrics)} names; at most {MAX_NAMES} per post", field="metrics")
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if len(name) > MAX_NAME_CHARS or not _NAME.fullmatch(name):
            raise InvalidInput(f"metric name {name[:80]!r} must be 1 to {MAX_NAME_CHARS} letters, digits or "
                               "'_.:/-'", field="metrics")
        field = f"metrics.{name}"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidInput(f"{field} must be a number, got {type(value).__name__}", field=field)
        as_float = numbers.real(value)
        if as_float is None:
            raise InvalidInput(f"{field} must be {numbers.describe(numbers.FLOAT64_MAX)}, got {str(value)[:40]}",
                               field=field)
        out[name] = as_float
    return out


_INSERT = ("INSERT INTO run_metrics (tenant_id, model_id, request_id, step, source, metrics) "
           "VALUES (%s, %s, %s, %s, %s, %s)")


def insert_trainer_row(conn: psycopg.Connection[DictRow], *, tenant_id: str, model_id: str, request_id: str,
                       row: StepMetrics) -> None:
    """Append a forward_backward's row; called by `billing.ledger.settle` inside its transaction."""
    conn.execute(_INSERT, (tenant_id, model_id, request_id, row.step, TRAINER, Jsonb(row.values)))


async def insert_client_row(conn: psycopg.AsyncConnection[DictRow], *, tenant_id: str, model_id: str, row: StepMetrics,
                            client_key: str | None = None) -> int:
    """Append a client's row (the API, after checking that the model is the caller's); returns its
    step. A `client_key` seen before on this model adds nothing and answers the first row's step."""
    cur = await conn.execute(
        "INSERT INTO run_metrics (tenant_id, model_id, step, source, metrics, client_key) VALUES (%s, %s, %s, %s, %s, %s) "
        "ON CONFLICT (model_id, client_key) WHERE client_key IS NOT NULL DO NOTHING RETURNING step",
        (tenant_id, model_id, row.step, CLIENT, Jsonb(row.values), client_key))
    if await cur.fetchone() is not None:
        return row.step
    cur = await conn.execute("SELECT step FROM run_metrics WHERE model_id = %s AND client_key = %s",
                             (model_id, client_key))
    found = await cur.fetchone()
    assert found is not None  # the conflicting row exists: the INSERT just met it
    return int(found["step"])
