"""Training routes: create a LoRA model, forward/backward, optimizer steps, save and load."""

from __future__ import annotations

from fastapi import APIRouter
from psycopg.types.json import Jsonb

from api import datums
from api.deps import Pool, RedisDep, Settings, Who
from api.schemas import (
    CreateModelRequest,
    ForwardBackwardRequest,
    LoadWeightsRequest,
    ModelRef,
    OptimStepRequest,
    SaveWeightsRequest,
)
from api.submit import _admit, enqueue, future_response, submit_model_request
from core import catalog, ids, queue
from core.errors import Forbidden, InvalidInput, NotFound
from core.settings import get_core_settings, get_trainer_settings
from tenancy import scoped

router = APIRouter(tags=["training"])


@router.post("/create_model")
async def create_model(body: CreateModelRequest, who: Who, pool: Pool, redis: RedisDep) -> dict:
    """Create a LoRA training model `{session_id}:train:{model_seq_id}` on a base model (a future)."""
    max_rank = get_trainer_settings().max_rank
    if body.lora_config.rank > max_rank:
        raise InvalidInput(f"lora_config.rank {body.lora_config.rank} exceeds the limit of {max_rank}",
                           field="lora_config.rank")
    model_id = ids.training_model_id(body.session_id, body.model_seq_id)
    async with pool.connection() as conn:
        session = await scoped.get_session(conn, who, body.session_id)
        if session["finished_at"] is not None:
            raise InvalidInput(f"session {body.session_id!r} has finished; create a new one", field="session_id")
        base = await catalog.get_model(conn, body.base_model)
        if base is None or not base.trainable:
            names = [m.name for m in await catalog.list_models(conn) if m.trainable]
            raise NotFound(f"base_model {body.base_model!r} is not served here; choose one of {names}",
                           field="base_model")
        cur = await conn.execute(
            "SELECT id FROM requests WHERE model_id = %s AND seq_id = 0 AND tenant_id = %s", (model_id, who.tenant_id)
        )
        existing = await cur.fetchone()
        if existing:
            return future_response(existing["id"], model_id)
        live = await scoped.count_live_models(conn, who)
        if live >= who.max_models:
            raise Forbidden(f"{live} live models reach your limit of {who.max_models}; "
                            "finish sessions you no longer use or ask an operator to raise max_models",
                            field="max_models")
        await _admit(conn, who)
        request_id = ids.new_request_id()
        lora = body.lora_config.model_dump()
        await conn.execute(
            "INSERT INTO training_models (id, tenant_id, session_id, model_seq_id, base_model, lora_config, user_metadata) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s)",
            (model_id, who.tenant_id, body.session_id, body.model_seq_id, base.name, Jsonb(lora),
             Jsonb(body.user_metadata or {})),
        )
        await conn.execute(
            "INSERT INTO requests (id, tenant_id, api_key_id, model_id, seq_id, kind) VALUES (%s, %s, %s, %s, 0, 'create_model')",
            (request_id, who.tenant_id, who.key_id, model_id),
        )
    await enqueue(pool, redis, base.name, queue.WorkItem(
        request_id=request_id, tenant_id=who.tenant_id, model_id=model_id, seq_id=0, kind="create_model",
        n_tokens=0, body={"lora_config": lora},
    ))
    return future_response(request_id, model_id)


@router.post("/get_info")
async def get_info(body: ModelRef, who: Who, pool: Pool) -> dict:
    """Describe a training model (not a future). `tokenizer_id` is a local path the client can load."""
    async with pool.connection() as conn:
        model = await scoped.get_model(conn, who, body.model_id)
        base = await catalog.get_model(conn, model["base_model"])
    return {
        "type": "get_info",
        "model_id": model["id"],
        "model_data": {"arch": "qwen3", "model_name": base.name, "tokenizer_id": base.path},
        "model_name": base.name,
        "is_lora": True,
        "lora_rank": model["lora_config"]["rank"],
        "status": model["status"],
    }


async def _forward(body: ForwardBackwardRequest, who, pool, redis, settings, *, forward_only: bool) -> dict:
    fb = body.forward_backward_input
    datums.check_loss_fn(fb.loss_fn)
    async with pool.connection() as conn:
        model = await scoped.get_model(conn, who, body.model_id)
        base = await catalog.get_model(conn, model["base_model"])
    limits = datums.Limits(base.vocab_size, base.max_context_length, settings.max_datums_per_request,
                           settings.max_tokens_per_request)
    data, n_tokens = datums.normalise([d.raw() for d in fb.data], fb.loss_fn, limits)
    work = {"loss_fn": fb.loss_fn, "loss_fn_config": datums.check_loss_config(fb.loss_fn_config),
            "forward_only": forward_only, "data": data}
    kind = "forward" if forward_only else "forward_backward"
    return await submit_model_request(pool, redis, who, model_id=body.model_id, seq_id=body.seq_id, kind=kind,
                                      body=work, n_tokens=n_tokens)


@router.post("/forward_backward")
async def forward_backward(body: ForwardBackwardRequest, who: Who, pool: Pool, redis: RedisDep, settings: Settings) -> dict:
    """Forward and backward pass; gradients accumulate until the next optim_step (a future)."""
    return await _forward(body, who, pool, redis, settings, forward_only=False)


@router.post("/forward")
async def forward(body: ForwardBackwardRequest, who: Who, pool: Pool, redis: RedisDep, settings: Settings) -> dict:
    """Forward pass only: loss and per-token logprobs, no gradients (a future)."""
    return await _forward(body, who, pool, redis, settings, forward_only=True)


@router.post("/optim_step")
async def optim_step(body: OptimStepRequest, who: Who, pool: Pool, redis: RedisDep) -> dict:
    """Apply one AdamW step with the accumulated gradients, then clear them (a future)."""
    return await submit_model_request(pool, redis, who, model_id=body.model_id, seq_id=body.seq_id,
                                      kind="optim_step", body={"adam_params": body.adam_params.model_dump()})


def _storage_dir(tenant_id: str, model_id: str, kind: str, name: str) -> str:
    return str(get_core_settings().checkpoint_dir / tenant_id / model_id / kind / name)


@router.post("/save_weights")
async def save_weights(body: SaveWeightsRequest, who: Who, pool: Pool, redis: RedisDep) -> dict:
    """Save adapter and optimizer state as `tinker://{model_id}/weights/{name}` (a future)."""
    work = {"name": body.path, "overwrite": body.overwrite,
            "storage_path": _storage_dir(who.tenant_id, body.model_id, "weights", body.path)}
    return await submit_model_request(pool, redis, who, model_id=body.model_id, seq_id=body.seq_id,
                                      kind="save_weights", body=work)


@router.post("/load_weights")
async def load_weights(body: LoadWeightsRequest, who: Who, pool: Pool, redis: RedisDep) -> dict:
    """Load a saved `tinker://.../weights/...` checkpoint of yours into this model (a future)."""
    try:
        run, kind, name = ids.parse_tinker_path(body.path)
    except ValueError as exc:
        raise InvalidInput(str(exc), field="path") from None
    if kind != "weights":
        raise InvalidInput(f"path must name a training checkpoint (.../weights/...), got kind {kind!r}", field="path")
    async with pool.connection() as conn:
        ckpt = await scoped.get_checkpoint(conn, who, run, kind, name)
    work = {"storage_path": ckpt["storage_path"], "optimizer": body.optimizer, "path": body.path}
    return await submit_model_request(pool, redis, who, model_id=body.model_id, seq_id=body.seq_id,
                                      kind="load_weights", body=work)
