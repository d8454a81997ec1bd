"""A training run's per-step metrics: clients add their own (RL rewards, evals); anyone holding a
key of the tenant reads them with the trainer's (loss per token, staleness, mismatch).

`step` is the model's policy version (optimizer steps), the x-axis the trainer's rows use too.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field

from api.deps import Pool, Who
from api.input_guard import GuardedRoute
from core import run_metrics
from tenancy import scoped

router = APIRouter(route_class=GuardedRoute, prefix="/quilt", tags=["runs"])

MAX_ROWS = 100_000


class LogMetricsRequest(BaseModel):
    # Types are checked by `run_metrics.check_*`, which name the metric and the limit it broke.
    model_config = ConfigDict(extra="forbid")

    step: Any = Field(None, description="policy version the values belong to; default: optimizer steps completed")
    metrics: Any = Field(description="name -> finite number, at most 64 names")
    idempotency_key: str | None = Field(None, min_length=8, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$",
                                        description="the same key again (a retry) records nothing new")


def rows_json(rows: list[dict]) -> list[dict]:
    return [{"step": r["step"], "source": r["source"], "metrics": r["metrics"], "time": r["created_at"].isoformat()}
            for r in rows]


@router.post("/models/{model_id}/metrics")
async def log_metrics(model_id: str, body: LogMetricsRequest, who: Who, pool: Pool) -> dict:
    """Record named scalars (`{"step": 12, "metrics": {"reward_mean": 0.4}}`) on one of your
    training models; the dashboard plots every name. Without `step`, the model's completed optimizer
    steps are used. With `idempotency_key`, repeating the call (a retry) records nothing new."""
    values = run_metrics.check_client_metrics(body.metrics)
    step = None if body.step is None else run_metrics.check_step(body.step)
    async with pool.connection() as conn:
        await scoped.get_model(conn, who, model_id)
        if step is None:
            step = (await scoped.run_progress(conn, who, [model_id]))[model_id]["step"]
        step = await run_metrics.insert_client_row(conn, tenant_id=who.tenant_id, model_id=model_id,
                                                   row=run_metrics.StepMetrics(step, values),
                                                   client_key=body.idempotency_key)
    return {"model_id": model_id, "step": step, "recorded": len(values)}


@router.get("/models/{model_id}/metrics")
async def get_metrics(model_id: str, who: Who, pool: Pool, limit: int = Query(10_000, ge=1, le=MAX_ROWS)) -> dict:
    """One of your training models' per-step metrics, by step: `source` is `trainer` (one row per
    forward_backward: `loss:mean` per weighted token, `loss:sum`, staleness, mismatch) or `client`."""
    async with pool.connection() as conn:
        rows = await scoped.list_run_metrics(conn, who, model_id, limit=limit)
    return {"model_id": model_id, "metrics": rows_json(rows)}
