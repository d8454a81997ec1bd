"""JSON the dashboard's scripts fetch and poll, authenticated by the session cookie. Reads only
(GET), so no CSRF token is needed; the same tenant-scoped queries as the pages."""

from __future__ import annotations

from fastapi import APIRouter, Query

from api.dashboard import ops
from api.dashboard.deps import LoggedIn, OperatorOnly
from api.dashboard.render import DataRoute
from api.deps import Pool, RedisDep, Settings
from api.routes.run_metrics import MAX_ROWS, rows_json
from tenancy import scoped

router = APIRouter(prefix="/dashboard/data", route_class=DataRoute, include_in_schema=False)


@router.get("/runs/{model_id}")
async def run_data(model_id: str, viewer: LoggedIn, pool: Pool) -> dict:
    """A run's state and its per-step metrics (trainer and client rows), for its curves."""
    async with pool.connection() as conn:
        model = await scoped.get_model(conn, viewer.who, model_id)
        progress = (await scoped.run_progress(conn, viewer.who, [model_id]))[model_id]
        rows = await scoped.list_run_metrics(conn, viewer.who, model_id, limit=MAX_ROWS)
    return {"model_id": model_id, "status": model["status"], **progress, "metrics": rows_json(rows)}


@router.get("/ops")
async def ops_data(viewer: OperatorOnly, pool: Pool, redis: RedisDep, settings: Settings,
                   minutes: int = Query(15, ge=1, le=24 * 60)) -> dict:
    """The operator page's numbers over the last `minutes` (operators only)."""
    async with pool.connection() as conn:
        return await ops.snapshot(conn, redis, window_s=minutes * 60,
                                  devices=(settings.capacity_gen_devices, settings.capacity_train_devices))
