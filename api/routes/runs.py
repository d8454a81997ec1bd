"""Training runs and checkpoints as REST resources (the tinker SDK's RestClient reads these).

A training run is a training model; its id is the model id (`{session_id}:train:{n}`), which is
also the first part of its checkpoints' `tinker://` paths.
"""

from __future__ import annotations

from fastapi import APIRouter, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from api import records
from api.deps import Pool, Who
from api.input_guard import GuardedRoute
from api.schemas import CheckpointTtlRequest, WeightsInfoRequest
from checkpoints import storage
from checkpoints.layout import EXTERNAL_KIND, SAMPLER_KIND, TRAINING_KIND
from core import ids
from core.errors import InvalidInput, NotFound
from core.numbers import INT32_MAX
from core.work import OPTIMIZERS
from tenancy import accounts, scoped
from tenancy.auth import Principal

router = APIRouter(route_class=GuardedRoute, tags=["runs"])

_CHECKPOINT_TYPE = {TRAINING_KIND: "training", SAMPLER_KIND: "sampler", EXTERNAL_KIND: "external"}


def checkpoint_json(row: dict) -> dict:
    return {
        "checkpoint_id": f"{row['kind']}/{row['name']}",
        "checkpoint_type": _CHECKPOINT_TYPE[row["kind"]],
        "time": row["created_at"].isoformat(),
        "tinker_path": ids.tinker_path(row["model_id"], row["kind"], row["name"]),
        "size_bytes": row["size_bytes"],
        "public": row.get("published_at") is not None,
        **({"expires_at": row["expires_at"].isoformat()} if row["expires_at"] else {}),
        **({"user_metadata": row["user_metadata"]} if row["user_metadata"] is not None else {}),
    }


def metadata_text(metadata: dict | None) -> dict[str, str]:
    """A row's `user_metadata` as the tinker SDK types it: text keys and values."""
    return {str(k): str(v) for k, v in (metadata or {}).items()}


def _run_json(model: dict, who: Principal, checkpoints: list[dict]) -> dict:
    last = {kind: next((c for c in checkpoints if c["kind"] == kind), None) for kind in (TRAINING_KIND, SAMPLER_KIND)}
    out = {
        "training_run_id": model["id"],
        "base_model": model["base_model"],
        "model_owner": who.tenant_name,
        "is_lora": True,
        "lora_rank": model["lora_config"]["rank"],
        "corrupted": model["status"] in ("failed", "lost"),
        "last_request_time": model["last_request_at"].isoformat(),
        "user_metadata": metadata_text(model["user_metadata"]),
        "status": model["status"],
    }
    if last["weights"]:
        out["last_checkpoint"] = checkpoint_json(last["weights"])
    if last["sampler_weights"]:
        out["last_sampler_checkpoint"] = checkpoint_json(last["sampler_weights"])
    return out


def _cursor(offset: int, limit: int, total: int) -> dict:
    return {"offset": offset, "limit": limit, "total_count": total}


@router.get("/training_runs")
async def list_training_runs(who: Who, pool: Pool, limit: int = Query(20, ge=1, le=1000),
                             offset: int = Query(0, ge=0, le=INT32_MAX), access_scope: str = "owned") -> dict:
    """Your training runs, newest first (`access_scope` other than `owned` sees the same: runs are private)."""
    async with pool.connection() as conn:
        models, total = await scoped.list_models(conn, who, limit=limit, offset=offset)
        runs = []
        for m in models:
            ckpts, _ = await scoped.list_checkpoints(conn, who, model_id=m["id"])
            runs.append(_run_json(m, who, ckpts))
    return {"training_runs": runs, "cursor": _cursor(offset, limit, total)}


@router.get("/training_runs/{run_id}")
async def get_training_run(run_id: str, who: Who, pool: Pool, access_scope: str = "owned") -> dict:
    """One of your training runs."""
    async with pool.connection() as conn:
        model = await scoped.get_model(conn, who, run_id)
        ckpts, _ = await scoped.list_checkpoints(conn, who, model_id=run_id)
    return _run_json(model, who, ckpts)


@router.get("/training_runs/{run_id}/checkpoints")
async def list_run_checkpoints(run_id: str, who: Who, pool: Pool) -> dict:
    """A run's checkpoints (training and sampler weights), newest first."""
    async with pool.connection() as conn:
        await scoped.get_model(conn, who, run_id)
        ckpts, total = await scoped.list_checkpoints(conn, who, model_id=run_id)
    return {"checkpoints": [checkpoint_json(c) for c in ckpts], "cursor": _cursor(0, len(ckpts), total)}


@router.get("/checkpoints")
async def list_user_checkpoints(who: Who, pool: Pool, limit: int = Query(100, ge=1, le=1000),
                                offset: int = Query(0, ge=0, le=INT32_MAX)) -> dict:
    """All your checkpoints across runs, newest first."""
    async with pool.connection() as conn:
        ckpts, total = await scoped.list_checkpoints(conn, who, limit=limit, offset=offset)
    return {"checkpoints": [checkpoint_json(c) for c in ckpts], "cursor": _cursor(offset, limit, total)}


def split_checkpoint_id(checkpoint_id: str) -> tuple[str, str]:
    kind, _, name = checkpoint_id.partition("/")
    if kind not in _CHECKPOINT_TYPE or not name:
        raise InvalidInput(f"checkpoint_id must look like <kind>/<name> with kind one of {list(_CHECKPOINT_TYPE)}, "
                           f"got {checkpoint_id!r}",
                           field="checkpoint_id")
    return kind, name


# Before the DELETE of `{checkpoint_id:path}`, which would take `<kind>/<name>/publish` for a
# checkpoint id; a checkpoint named `publish` (`<kind>/publish`, two segments) still reaches it.
@router.api_route("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish", methods=["POST", "DELETE"],
                  status_code=204)
async def publish_checkpoint(run_id: str, kind: str, name: str, request: Request, who: Who, pool: Pool) -> Response:
    """Publish (POST) one of your checkpoints: every tenant may then sample, copy and download it
    through its tinker path; or unpublish it (DELETE), which stops all three at once. Repeating
    either changes nothing; each change is recorded in your audit log."""
    kind, name = split_checkpoint_id(f"{kind}/{name}")
    publish = request.method == "POST"
    async with pool.connection() as conn:
        ckpt = await scoped.get_checkpoint(conn, who, run_id, kind, name)
        path = ids.tinker_path(run_id, kind, name)
        # Already so: done, not a 409 (tinker's documents say 409, but its SDK retries a 409 until it
        # gives up, so a repeated publish would hang the caller for minutes).
        if await records.set_published(conn, ckpt["id"], publish):
            await accounts.record_async(conn, who.tenant_id, who.actor,
                                        "checkpoint.published" if publish else "checkpoint.unpublished", tinker_path=path)
    return Response(status_code=204)


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}", status_code=204)
async def delete_checkpoint(run_id: str, checkpoint_id: str, who: Who, pool: Pool) -> Response:
    """Delete one of your checkpoints and its files."""
    kind, name = split_checkpoint_id(checkpoint_id)
    async with pool.connection() as conn:
        ckpt = await scoped.get_checkpoint(conn, who, run_id, kind, name)
        last = await records.delete_checkpoint(conn, ckpt["id"])
    # Earlier versions of the name are already queued for deletion (checkpoints.retention); files a
    # copy still names stay for it (copy_weights).
    if last:
        await run_in_threadpool(storage.get_store().remove, ckpt["storage_path"])
    return Response(status_code=204)


@router.put("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl", status_code=204)
async def set_checkpoint_ttl(run_id: str, checkpoint_id: str, body: CheckpointTtlRequest, who: Who,
                             pool: Pool) -> Response:
    """Expire one of your checkpoints `ttl_seconds` from now, or never (`null`). Replaces any
    earlier expiry, including the default one of anonymous sampler snapshots."""
    kind, name = split_checkpoint_id(checkpoint_id)
    async with pool.connection() as conn:
        ckpt = await scoped.get_checkpoint(conn, who, run_id, kind, name)
        await records.expire_checkpoint(conn, ckpt["id"], body.ttl_seconds)
    return Response(status_code=204)


@router.post("/weights_info")
async def weights_info(body: WeightsInfoRequest, who: Who, pool: Pool) -> dict:
    """What a `tinker://` checkpoint of yours (or a published one) holds: its base model, LoRA shape
    and optimizer (its run's, as `optimizer_config`)."""
    try:
        run, kind, name = ids.parse_tinker_path(body.tinker_path)
    except ValueError as exc:
        raise InvalidInput(str(exc), field="tinker_path") from None
    if kind not in _CHECKPOINT_TYPE:
        raise NotFound(f"checkpoint {body.tinker_path!r} not found", field="tinker_path")
    async with pool.connection() as conn:
        model = await scoped.readable_checkpoint(conn, who, run, kind, name, field="tinker_path")
    lora = model["lora_config"]
    return {"base_model": model["base_model"], "is_lora": True, "lora_rank": lora["rank"],
            "train_unembed": lora.get("train_unembed", True), "train_mlp": lora.get("train_mlp", True),
            "train_attn": lora.get("train_attn", True), "optimizer_config": OPTIMIZERS[model["optimizer"]]}


