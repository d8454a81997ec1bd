"""Training routes: create a LoRA model, forward/backward, optimizer steps, save and load."""

from __future__ import annotations

import asyncio
import dataclasses

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from api import admission, caller_cache, datums, images, provenance, records, seq_gaps, tinker_proto
from api.deps import Callers, Pool, RedisDep, Settings, Who
from api.input_guard import DenseBodyRoute, GuardedRoute
from api.routes.sharing import granted_checkpoint
from api.schemas import (
    CreateCustomLossRequest,
    CreateModelRequest,
    ForwardBackwardRequest,
    ForwardRequest,
    LoadWeightsRequest,
    ModelRef,
    OptimizerConfig,
    OptimStepRequest,
    SaveWeightsExternalRequest,
    SaveWeightsRequest,
)
from bases import architectures, catalog, memory_plan
from checkpoints import encryption
from checkpoints.layout import EXTERNAL_KIND, TRAINING_KIND, new_version_dir
from core import custom_loss, db, health, ids, queue
from core.errors import InvalidInput, NotFound
from core.loss_spec import CUSTOM, spec_of
from core.numbers import INT32_MAX
from core.settings import get_api_settings, get_core_settings, get_gen_pool_settings, get_trainer_settings
from core.work import (
    ADAMW,
    OPTIMIZERS,
    AdamParams,
    CreateModel,
    DimuonParams,
    LoadWeights,
    LoraShape,
    OptimStep,
    SaveWeights,
    WorkItem,
    WorkKind,
    check_family,
    family_of,
    load_family,
)
from tenancy import scoped

router = APIRouter(route_class=GuardedRoute, tags=["training"])


def _plan_longest_row(base) -> int | None:
    """The longest row the base's trainer can train by its memory plan, where this process knows the
    trainer's device memory (QUILT_TRAINER_GPU_MEMORY); None where it does not."""
    trainer = get_trainer_settings()
    if not trainer.gpu_memory or not base.config:
        return None
    plan = memory_plan.trainer_plan(base.config, trainer, get_gen_pool_settings(), max_context=base.max_context_length)
    return memory_plan.longest_row(base.config, plan.inputs)


async def _new_model(pool, redis, who, *, session_id: str, model_seq_id: int, base_model: str, lora: LoraShape,
                     user_metadata: dict | None, load: LoadWeights | None, optimizer: str,
                     context: int | None = None) -> dict:
    """Record a new training model with its optimizer family and context length (`context` asked
    for, else the standard one: bases.memory_plan.model_context) and queue its first request
    (seq_id 0): a create, or a create-from-checkpoint. A repeat of the same (session,
    model_seq_id) returns the first future."""
    model_id = ids.training_model_id(session_id, model_seq_id)
    async with pool.connection() as conn:
        session = await scoped.get_session(conn, who, session_id)
        if session["finished_at"] is not None:
            raise InvalidInput(f"session {session_id!r} has finished; create a new one", field="session_id")
        base = await catalog.get_model(conn, base_model)
        if base is None or not base.trainable:
            names = [m.name for m in await catalog.list_models(conn) if m.trainable]
            raise NotFound(f"base_model {base_model!r} is not served here; choose one of {names}", field="base_model")
        if base.config:  # a LoRA this base cannot carry: 400 now, not a failed future later
            architectures.lora_targets(base.config, lora.to_json(), expert_lora=base.serving.get("expert_lora", True))
        context_length = memory_plan.model_context(context, base_context=base.max_context_length,
                                                   standard=get_api_settings().standard_context_length,
                                                   plan_longest=_plan_longest_row(base))
        slot = admission.SeqSlot(model_id, 0, *await records.seq_holder(conn, model_id, 0))
        item = WorkItem(ids.new_request_id(), who.tenant_id, model_id, 0, WorkKind.CREATE_MODEL, 0,
                        CreateModel(lora, load, optimizer))
        new = records.NewModel(session_id, model_seq_id, base.name, lora.to_json(), user_metadata or {}, optimizer,
                               context_length)
        request_id = await admission.admit(conn, redis, who, admission.Ticket(item, base.name, slot, new_model=new))
    return admission.future_response(request_id, model_id)


async def _model_call(conn, redis, who, model_id: str, *, seq_id: int, kind: WorkKind, body, n_tokens: int = 0) -> dict:
    """Admit one call on an existing model (`admission.admit_call`; `conn` in autocommit)."""
    item = WorkItem(ids.new_request_id(), who.tenant_id, model_id, seq_id, kind, n_tokens, body)
    return admission.future_response(await admission.admit_call(conn, redis, who, item), model_id)


async def _queue_on_model(pool, redis, who, *, model_id: str, seq_id: int, kind: WorkKind, body) -> dict:
    """A call whose body needs nothing of the model: admitted by one statement (admission)."""
    async with db.autocommit(pool) as conn:
        return await _model_call(conn, redis, who, model_id, seq_id=seq_id, kind=kind, body=body)


@router.post("/create_model")
async def create_model(body: CreateModelRequest, who: Who, pool: Pool, redis: RedisDep) -> dict:
    """Create a LoRA training model `{session_id}:train:{model_seq_id}` on a base model (a future),
    with the optimizer `optimizer_config` names (AdamW when left out; `{"type": "dimuon"}`: Dimuon),
    which the model keeps for its life."""
    max_rank = get_trainer_settings().max_rank
    if body.lora_config.rank > max_rank:
        raise InvalidInput(f"lora_config.rank {body.lora_config.rank} exceeds the limit of {max_rank}",
                           field="lora_config.rank")
    return await _new_model(pool, redis, who, session_id=body.session_id, model_seq_id=body.model_seq_id,
                            base_model=body.base_model, lora=LoraShape(**body.lora_config.model_dump()),
                            user_metadata=body.user_metadata, load=None, optimizer=_family(body.optimizer_config),
                            context=body.max_context_length)


@router.post("/get_info")
async def get_info(body: ModelRef, who: Who, pool: Pool, redis: RedisDep, callers: Callers) -> dict:
    """Describe a training model (not a future). `tokenizer_id` is the hub id of a hub base (so the
    tinker SDK and cookbook load the real tokenizer) and the local path of a local one.
    `status` is `recovering` from the moment its trainer is gone (no heartbeat) until the restarted
    trainer has restored it and replayed its requests since the last snapshot; then `ready`."""
    model = caller_cache.cached_model(callers, who, body.model_id)
    base = callers.get("base", model["base_model"]) if model else None
    if base is None:
        async with db.autocommit(pool) as conn:
            model = await caller_cache.training_model(callers, conn, who, body.model_id)
            base = await caller_cache.base_model(callers, conn, model["base_model"])
    status = model["status"]
    trainer = health.model_trainer_key(base.name, model.get("trainer_shard"), get_core_settings().trainer_shards)
    if status == "ready" and not await redis.exists(trainer):
        status = "recovering"
    return {
        "type": "get_info",
        "model_id": model["id"],
        "model_data": {"arch": base.architecture, "model_name": base.name, "tokenizer_id": base.client_tokenizer},
        "model_name": base.name,
        "is_lora": True,
        "lora_rank": model["lora_config"]["rank"],
        "optimizer_config": OPTIMIZERS[model["optimizer"]],
        "status": status,
    }


async def _parse_forward(request: Request, settings, *, forward_only: bool) -> tinker_proto.ForwardBackwardProto:
    """The same request from either encoding: JSON (Quilt SDK) or protobuf (tinker SDK)."""
    if tinker_proto.PROTOBUF in request.headers.get("content-type", ""):
        # Sparse tensors expand to at most what the largest dense body could carry.
        parsed = tinker_proto.decode_forward_backward(
            await request.body(), max_sparse_values=settings.max_body_bytes // 4,
            on_ids=lambda model_id, seq_id: seq_gaps.claim(request, model_id, seq_id))
        return dataclasses.replace(parsed, forward_only=parsed.forward_only or forward_only)
    raw = await request.json()  # parsed and checked by the route's guard (api.input_guard)
    # From here a refusal uses up the call's seq_id: a datum's bad provenance is refused while the
    # datums are read, and the model's later calls must not wait for it.
    seq_gaps.claim_from_body(request, raw)
    # /forward takes tinker's ForwardRequest (`forward_input`); a Quilt SDK before 0.2 sent
    # `forward_backward_input` there, read when `forward_input` is absent.
    tinker_forward = forward_only and not (isinstance(raw, dict) and "forward_backward_input" in raw
                                           and "forward_input" not in raw)
    try:
        body = (ForwardRequest if tinker_forward else ForwardBackwardRequest).model_validate(raw)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(), body=raw) from None
    fb = body.forward_input if tinker_forward else body.forward_backward_input
    return tinker_proto.ForwardBackwardProto(body.model_id, body.seq_id, fb.loss_fn, fb.loss_fn_config or {},
                                             forward_only, [d.raw(f"data[{i}].model_input") for i, d in enumerate(fb.data)])


async def _forward(request: Request, who, pool, redis, settings, callers, *, forward_only: bool) -> dict:
    req = await _parse_forward(request, settings, forward_only=forward_only)
    seq_gaps.claim(request, req.model_id, req.seq_id)
    if not 1 <= req.seq_id <= INT32_MAX:
        raise InvalidInput(f"seq_id must be in [1, {INT32_MAX}], got {req.seq_id}", field="seq_id")
    # Looked up once here, before the model is read (a bad loss_fn is a 400 whatever the model),
    # and passed on to every check behind it.
    spec = spec_of(req.loss_fn) if req.loss_fn != CUSTOM else None
    async with db.autocommit(pool) as conn:
        # The base's limits, which never change for a model, usually from the cache: the call then
        # waits on one statement and its append (admission).
        model = admission.usable(await caller_cache.training_model(callers, conn, who, req.model_id))
        limits = datums.Limits(model["vocab_size"], model["max_context_length"], settings.max_datums_per_request,
                               settings.max_tokens_per_request)
        if any(d.raw_images for d in req.data):  # read the base only for a request with images
            base = await catalog.get_model(conn, model["base_model"])
            if base is None:
                raise NotFound(f"base model {model['base_model']!r} is no longer served")
            # Off the event loop: decoding, and reading pointed-at assets from the object store, block.
            req = dataclasses.replace(req, data=await asyncio.to_thread(images.prepare, req.data, base, settings,
                                                                        who.tenant_id))
        if spec is None:
            graph = await _custom_loss(conn, who, model, req.loss_fn_config)
            work, n_tokens = datums.custom_pass_work(graph, req.data, limits)
        else:
            work, n_tokens = datums.pass_work(spec, req.loss_fn_config, req.data, limits)
        work = await provenance.apply(redis, who.tenant_id, work, [d.provenance for d in req.data],
                                      get_gen_pool_settings().stability_ttl_s)
        kind = WorkKind.FORWARD if req.forward_only else WorkKind.FORWARD_BACKWARD
        return await _model_call(conn, redis, who, req.model_id, seq_id=req.seq_id, kind=kind, body=work,
                                 n_tokens=n_tokens)


async def _custom_loss(conn, who, model: dict, config: dict | None) -> custom_loss.LossGraph:
    """The graph a `custom` loss_fn names by `loss_fn_config.loss_id`: one of this model's session's
    (404 otherwise, another session's or tenant's included)."""
    loss_id = (config or {}).get("loss_id")
    if not isinstance(loss_id, str) or set(config or {}) != {"loss_id"}:
        raise InvalidInput("loss_fn_config: loss_fn 'custom' takes exactly {\"loss_id\": <the id create_custom_loss "
                           "returned>}", field="loss_fn_config.loss_id")
    row = await scoped.get_custom_loss(conn, who, loss_id, model["session_id"])
    return custom_loss.LossGraph.from_json(row["graph"])


async def create_custom_loss(body: CreateCustomLossRequest, who: Who, pool: Pool, redis: RedisDep,
                             settings: Settings) -> dict:
    """Store a custom loss traced by the tinker SDK, for `forward_backward` with loss_fn `custom` and
    `{"loss_id": ...}` in the same session (a future of `{"loss_id"}`). The graph is rebuilt from
    Quilt's allow-list (`core.custom_loss`): a node outside it is a 400 naming the node. A repeat of
    the same (session, custom_loss_seq_id) answers the first loss's id."""
    graph = custom_loss.parse(body.name, body.inputs, body.graph)
    loss_id = f"{body.session_id}:loss:{body.custom_loss_seq_id}"
    async with db.autocommit(pool) as conn:
        session = await scoped.get_session(conn, who, body.session_id)
        if session["finished_at"] is not None:
            raise InvalidInput(f"session {body.session_id!r} has finished; create a new one", field="session_id")
        row = await records.insert_custom_loss(conn, who, loss_id, session_id=body.session_id,
                                               seq_id=body.custom_loss_seq_id, name=graph.name, graph=graph.to_json(),
                                               max_per_session=settings.max_custom_losses_per_session)
    if row is None:
        raise InvalidInput(f"session {body.session_id!r} holds {settings.max_custom_losses_per_session} custom losses, "
                           "the limit (QUILT_MAX_CUSTOM_LOSSES_PER_SESSION); reuse their handles", field="session_id")
    if row["graph"] != graph.to_json():
        raise InvalidInput(f"custom_loss_seq_id {body.custom_loss_seq_id} is already used by another loss "
                           f"({row['name']!r})", field="custom_loss_seq_id")
    request_id = ids.new_request_id()
    await queue.publish_answer(redis, queue.Outcome(request_id, result={"loss_id": loss_id, "type": "create_custom_loss"}),
                               settings.future_ttl_seconds, who.tenant_id, "create_custom_loss")
    return {"request_id": request_id}


# The SDK writes a graph at about ten bytes a string, denser than other bodies (api.input_guard).
router.add_api_route("/create_custom_loss", create_custom_loss, methods=["POST"], route_class_override=DenseBodyRoute)


# The forward routes read their body themselves (JSON or protobuf), so FastAPI does not know its
# models: the JSON schemas' definitions are added to the document's components (api.app).
def _body(model) -> tuple[dict, dict]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs")
    return {"requestBody": {"content": {
        "application/json": {"schema": schema},
        tinker_proto.PROTOBUF: {"schema": {"type": "string", "format": "binary",
                                           "description": "tinker_public.ForwardBackwardRequest"}},
    }}}, defs


_FORWARD_BACKWARD_BODY, _FB_DEFS = _body(ForwardBackwardRequest)
_FORWARD_BODY, _F_DEFS = _body(ForwardRequest)
SCHEMA_COMPONENTS = {**_FB_DEFS, **_F_DEFS}


@router.post("/forward_backward", openapi_extra=_FORWARD_BACKWARD_BODY)
async def forward_backward(request: Request, who: Who, pool: Pool, redis: RedisDep, settings: Settings,
                           callers: Callers) -> dict:
    """Forward and backward pass; gradients accumulate until the next optim_step (a future).
    Accepts a JSON body or a `tinker_public.ForwardBackwardRequest` protobuf (tinker SDK)."""
    return await _forward(request, who, pool, redis, settings, callers, forward_only=False)


@router.post("/forward", openapi_extra=_FORWARD_BODY)
async def forward(request: Request, who: Who, pool: Pool, redis: RedisDep, settings: Settings,
                  callers: Callers) -> dict:
    """Forward pass only: loss and per-token logprobs, no gradients (a future)."""
    return await _forward(request, who, pool, redis, settings, callers, forward_only=True)


@router.post("/optim_step")
async def optim_step(body: OptimStepRequest, request: Request, who: Who, pool: Pool, redis: RedisDep,
                     callers: Callers) -> dict:
    """Apply one step of the model's optimizer with the accumulated gradients, then clear them (a
    future): `adam_params` for an AdamW model, `optimizer_params` (DimuonParams) for a Dimuon one;
    the other family's parameters are a 400 naming their field."""
    seq_gaps.claim(request, body.model_id, body.seq_id)
    if (body.adam_params is None) == (body.optimizer_params is None):
        raise InvalidInput("send the step's hyperparameters once: adam_params (AdamW) or optimizer_params (Dimuon)",
                           field="adam_params" if body.adam_params is None else "optimizer_params")
    params = (AdamParams(**body.adam_params.model_dump()) if body.adam_params is not None
              else DimuonParams(**body.optimizer_params.model_dump(exclude={"type"})))
    async with db.autocommit(pool) as conn:
        model = await caller_cache.training_model(callers, conn, who, body.model_id)
        check_family(model["optimizer"], family_of(params))
        return await _model_call(conn, redis, who, body.model_id, seq_id=body.seq_id, kind=WorkKind.OPTIM_STEP,
                                 body=OptimStep(params))


@router.post("/save_weights")
async def save_weights(body: SaveWeightsRequest, request: Request, who: Who, pool: Pool, redis: RedisDep) -> dict:
    """Save adapter and optimizer state as `tinker://{model_id}/weights/{name}` (a future);
    `ttl_seconds` deletes it that long after the save."""
    seq_gaps.claim(request, body.model_id, body.seq_id)
    work = SaveWeights(name=body.path, overwrite=body.overwrite, ttl_s=body.ttl_seconds,
                       user_metadata=body.user_metadata,
                       storage_path=new_version_dir(get_core_settings().checkpoint_dir, who.tenant_id, body.model_id,
                                                    TRAINING_KIND, body.path))
    return await _queue_on_model(pool, redis, who, model_id=body.model_id, seq_id=body.seq_id,
                             kind=WorkKind.SAVE_WEIGHTS, body=work)


@router.post("/save_weights_external")
async def save_weights_external(body: SaveWeightsExternalRequest, request: Request, who: Who, pool: Pool,
                                redis: RedisDep) -> dict:
    """Export the adapter alone (a PEFT directory: adapter_config.json, adapter_model.safetensors)
    as `tinker://{model_id}/external_weights/{name}` (a future); fetch its files with
    `GET training_runs/{run}/checkpoints/external_weights/{name}/external_weights_urls`. Saving a
    name again replaces it. With `age_encryption_recipients` (x25519 `age1...` keys or ssh public
    keys, at most 10) every file is encrypted to them with age and served as `<file>.age`: only
    their identities can read it, so the server cannot merge it (tinker-cookbook's
    `weights.download` decrypts it)."""
    seq_gaps.claim(request, body.model_id, body.seq_id)
    work = SaveWeights(name=body.path, overwrite=True, ttl_s=body.ttl_seconds,
                       storage_path=new_version_dir(get_core_settings().checkpoint_dir, who.tenant_id, body.model_id,
                                                    EXTERNAL_KIND, body.path),
                       age_recipients=encryption.check_recipients(body.age_encryption_recipients or []))
    return await _queue_on_model(pool, redis, who, model_id=body.model_id, seq_id=body.seq_id,
                                 kind=WorkKind.SAVE_WEIGHTS_EXTERNAL, body=work)


@router.post("/load_weights")
async def load_weights(body: LoadWeightsRequest, request: Request, who: Who, pool: Pool, redis: RedisDep) -> dict:
    """Load a `tinker://.../weights/...` checkpoint of yours, or another tenant's that its
    `weights_access_token` grants (a future): into an existing model (`model_id`, `seq_id`), or as a
    new model `{session_id}:train:{model_seq_id}` whose LoRA shape and base come from the checkpoint."""
    seq_gaps.claim(request, body.model_id, body.seq_id)
    try:
        run, kind, name = ids.parse_tinker_path(body.path)
    except ValueError as exc:
        raise InvalidInput(str(exc), field="path") from None
    if kind != TRAINING_KIND:
        raise InvalidInput(f"path must name a training checkpoint (.../weights/...), got kind {kind!r}", field="path")
    async with pool.connection() as conn:
        if body.weights_access_token is None:
            ckpt = await scoped.get_checkpoint(conn, who, run, kind, name)
        else:
            ckpt = await granted_checkpoint(conn, who, body.path, body.weights_access_token)
        target = await scoped.get_model(conn, who, body.model_id) if body.model_id is not None else None
        try:
            # Another tenant's checkpoint carries its run's base, LoRA shape and optimizer (granted_checkpoint).
            source = ckpt if ckpt["tenant_id"] != who.tenant_id else await scoped.get_model(conn, who, run)
        except NotFound:
            if target is None:
                raise
            source = None  # a deleted run's checkpoint: the trainer checks its optimizer state (checkpoints.layout)
    if target is None and body.base_model not in (None, source["base_model"]):
        raise InvalidInput(f"base_model {body.base_model!r}: a checkpoint loads onto its own base "
                           f"({source['base_model']!r}); leave base_model out", field="base_model")
    family = load_family(optimizer=body.optimizer, asked=_family(body.optimizer_config) if body.optimizer_config else None,
                         saved=source["optimizer"] if source else None, model=target["optimizer"] if target else None)
    load = LoadWeights(storage_path=ckpt["storage_path"], optimizer=body.optimizer, path=body.path)
    if body.model_id is None:
        return await _new_model(pool, redis, who, session_id=body.session_id, model_seq_id=body.model_seq_id,
                                base_model=source["base_model"], lora=LoraShape.from_json(source["lora_config"]),
                                user_metadata=body.user_metadata, load=load, optimizer=family)
    return await _queue_on_model(pool, redis, who, model_id=body.model_id, seq_id=body.seq_id,
                             kind=WorkKind.LOAD_WEIGHTS, body=load)


def _family(config: OptimizerConfig | None) -> str:
    """The optimizer family an optimizer_config names (AdamW when there is none)."""
    return config.type if config is not None else ADAMW

