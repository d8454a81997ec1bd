"""Sampling routes: publish adapter weights for sampling, sampling sessions, `asample`, cancellation.

    save_weights_for_sampler   a trainer request (seq_id order): named -> {"path"}; anonymous
                               (sampling_session_seq_id) -> {"sampling_session_id"} bound to it
    create_sampling_session    a sampler on one of your sampler_weights paths, or on a base model
    GET samplers/{id}          {"sampler_id", "base_model", "model_path"?}
    asample                    a future with `sample_sequence_ids`; compute_logprobs is an asample
                               with prompt_logprobs=true and max_tokens=1
    cancel_future              aborts a sampling request (its future fails as cancelled)

Every publication is written to its own directory (`.../sampler_weights/<name>/<version>`), never
rewritten, so the generation pool can treat the directory as the adapter version's identity.
Anything that is not the caller's is 404, like a missing thing.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field, field_validator, model_validator

from api import seq_gaps
from api.deps import Pool, RedisDep, Settings, Who
from api.schemas import ModelInputIn, _Body
from api.submit import _admit, submit_model_request
from core import catalog, ids, queue, retention
from core.errors import InvalidInput, NotFound
from core.settings import get_core_settings
from gen_pool import params
from gen_pool.adapters import AdapterRef
from gen_pool.settings import get_gen_pool_settings
from tenancy import scoped

log = logging.getLogger("quilt.api.sampling")
router = APIRouter(tags=["sampling"])

SAMPLER_KIND = "sampler_weights"


# --------------------------------------------------------------------------- bodies


def _check_name(value: str | None) -> str | None:
    if value is not None and not ids.CHECKPOINT_NAME_RE.match(value):
        raise ValueError("checkpoint name must be 1-128 characters of letters, digits, '.', '_' or '-'")
    return value


class SaveWeightsForSamplerRequest(_Body):
    model_id: str = Field(max_length=256)
    seq_id: int = Field(ge=1, le=2**31 - 1)
    path: str | None = Field(None, description="checkpoint name (named form)")
    sampling_session_seq_id: int | None = Field(None, ge=0, le=2**31 - 1, description="anonymous form")
    kind: str | None = Field(None, max_length=32)
    ttl_seconds: int | None = Field(None, ge=retention.MIN_TTL_S, le=retention.MAX_TTL_S,
                                    description="delete the weights this long after the save; default: named "
                                                "kept, anonymous expire QUILT_ANON_SAMPLER_TTL_S after last use")

    @field_validator("path")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        return _check_name(value)

    @model_validator(mode="after")
    def _one_form(self) -> SaveWeightsForSamplerRequest:
        if self.path is None and self.sampling_session_seq_id is None:
            raise ValueError("give either path (a checkpoint name) or sampling_session_seq_id")
        return self


class CreateSamplingSessionRequest(_Body):
    session_id: str = Field(max_length=128)
    sampling_session_seq_id: int = Field(ge=0, le=2**31 - 1)
    model_path: str | None = Field(None, max_length=1024)
    base_model: str | None = Field(None, max_length=256)

    @model_validator(mode="after")
    def _one_target(self) -> CreateSamplingSessionRequest:
        if (self.model_path is None) == (self.base_model is None):
            raise ValueError("give exactly one of model_path or base_model")
        return self


class SamplingParamsIn(_Body):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[int] | list[str] | None = None
    temperature: float = Field(1.0, allow_inf_nan=False)
    top_k: int = -1
    top_p: float = Field(1.0, allow_inf_nan=False)


class SampleRequest(_Body):
    sampling_session_id: str | None = Field(None, max_length=256)
    seq_id: int | None = None
    base_model: str | None = Field(None, max_length=256)
    model_path: str | None = Field(None, max_length=1024)
    num_samples: int = Field(1, ge=1)
    prompt: ModelInputIn
    sampling_params: SamplingParamsIn = Field(default_factory=SamplingParamsIn)
    prompt_logprobs: bool = False
    prompt_logprobs_last_n: int | None = Field(None, ge=0)
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_alt_tokens_k: int = 0
    deadline_s: float | None = Field(None, gt=0, allow_inf_nan=False,
                                     description="Quilt: abort and fail the request if unfinished after this")


class CancelFutureRequest(_Body):
    request_id: str = Field(max_length=128)


# --------------------------------------------------------------------------- helpers


def _sampler_path(path: str) -> tuple[str, str]:
    try:
        run, kind, name = ids.parse_tinker_path(path)
    except ValueError as exc:
        raise InvalidInput(str(exc), field="model_path") from None
    if kind != SAMPLER_KIND:
        raise InvalidInput(f"model_path must name sampler weights (tinker://<run>/{SAMPLER_KIND}/<name>), "
                           f"got kind {kind!r}; publish them with save_weights_for_sampler", field="model_path")
    return run, name


async def _base_of_model(conn, model_id: str) -> str:
    cur = await conn.execute("SELECT base_model FROM training_models WHERE id = %s", (model_id,))
    return (await cur.fetchone())["base_model"]


async def _sampleable(conn, name: str) -> catalog.BaseModel:
    base = await catalog.get_model(conn, name)
    if base is None or not base.sampleable:
        names = [m.name for m in await catalog.list_models(conn) if m.sampleable]
        raise NotFound(f"base_model {name!r} is not served here; choose one of {names}", field="base_model")
    return base


def _sampler_json(row: dict) -> dict:
    out = {"sampler_id": row["id"], "base_model": row["base_model"]}
    if row["model_path"]:
        out["model_path"] = row["model_path"]
    return out


# --------------------------------------------------------------------------- routes


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(body: SaveWeightsForSamplerRequest, request: Request, who: Who, pool: Pool,
                                   redis: RedisDep) -> dict:
    """Publish the adapter's current weights as a new version for sampling (a future, in seq_id order).

    Named: resolves to `{"path": "tinker://{model_id}/sampler_weights/{name}", "policy_version"}`;
    publishing a name again makes a new version of it. Anonymous: resolves to
    `{"sampling_session_id"}`, a sampler bound to exactly these weights (a snapshot), which expires
    QUILT_ANON_SAMPLER_TTL_S after its last use unless `ttl_seconds` says otherwise.
    """
    seq_gaps.claim(request, body.model_id, body.seq_id)
    work: dict[str, Any] = {"overwrite": True}
    async with pool.connection() as conn:
        model = await scoped.get_model(conn, who, body.model_id)
        if body.path is not None:
            name = body.path
        else:
            # Deterministic, so a retried submission names the same weights as the first one.
            name = f"anon-{body.seq_id}"
            sid = f"{model['session_id']}:sample:{body.sampling_session_seq_id}"
            path = ids.tinker_path(body.model_id, SAMPLER_KIND, name)
            cur = await conn.execute(
                "INSERT INTO sampling_sessions (id, tenant_id, session_id, seq_id, base_model, model_id, model_path) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO NOTHING RETURNING id",
                (sid, who.tenant_id, model["session_id"], body.sampling_session_seq_id, model["base_model"],
                 body.model_id, path),
            )
            if await cur.fetchone() is None:
                row = await scoped.get_sampling_session(conn, who, sid)
                if row["model_path"] != path:
                    raise InvalidInput(f"sampling_session_seq_id {body.sampling_session_seq_id} is already used "
                                       f"by sampler {sid!r}", field="sampling_session_seq_id")
            work["sampling_session_id"] = sid
    life = retention.lifetime(anonymous=body.path is None, ttl_seconds=body.ttl_seconds,
                              anon_ttl_s=get_core_settings().anon_sampler_ttl_s)
    # A new directory per publication: the pool may still serve (and reload) the previous version.
    work.update(name=name, ttl_s=life.ttl_s, sliding=life.sliding,
                storage_path=retention.new_version_dir(get_core_settings().checkpoint_dir, who.tenant_id,
                                                       body.model_id, SAMPLER_KIND, name))
    return await submit_model_request(pool, redis, who, model_id=body.model_id, seq_id=body.seq_id,
                                      kind="save_weights_for_sampler", body=work)


@router.post("/create_sampling_session")
async def create_sampling_session(body: CreateSamplingSessionRequest, who: Who, pool: Pool) -> dict:
    """A sampler on your published weights (`model_path`) or on a base model (`base_model`)."""
    sid = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
    async with pool.connection() as conn:
        session = await scoped.get_session(conn, who, body.session_id)
        if session["finished_at"] is not None:
            raise InvalidInput(f"session {body.session_id!r} has finished; create a new one", field="session_id")
        model_id = None
        if body.model_path is not None:
            run, name = _sampler_path(body.model_path)
            await scoped.get_checkpoint(conn, who, run, SAMPLER_KIND, name)
            base_name, model_id = await _base_of_model(conn, run), run
        else:
            base_name = (await _sampleable(conn, body.base_model)).name
        await conn.execute(
            "INSERT INTO sampling_sessions (id, tenant_id, session_id, seq_id, base_model, model_id, model_path) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO NOTHING",
            (sid, who.tenant_id, body.session_id, body.sampling_session_seq_id, base_name, model_id, body.model_path),
        )
        row = await scoped.get_sampling_session(conn, who, sid)
    if row["model_path"] != body.model_path or row["base_model"] != base_name:
        raise InvalidInput(f"sampling_session_seq_id {body.sampling_session_seq_id} is already used by sampler "
                           f"{sid!r}", field="sampling_session_seq_id")
    return {"sampling_session_id": sid, "type": "create_sampling_session"}


@router.get("/samplers/{sampling_session_id}")
async def get_sampler(sampling_session_id: str, who: Who, pool: Pool) -> dict:
    """Which base model (and which published weights, if any) a sampler samples."""
    async with pool.connection() as conn:
        return _sampler_json(await scoped.get_sampling_session(conn, who, sampling_session_id))


async def _resolve(conn, who, body: SampleRequest) -> tuple[catalog.BaseModel, AdapterRef | None]:
    path = body.model_path
    if body.sampling_session_id is not None:
        row = await scoped.get_sampling_session(conn, who, body.sampling_session_id)
        path, base_name = row["model_path"], row["base_model"]
    elif path is None:
        if body.base_model is None:
            raise InvalidInput("give sampling_session_id, model_path or base_model", field="sampling_session_id")
        base_name = body.base_model
    if path is None:
        return await _sampleable(conn, base_name), None
    run, name = _sampler_path(path)
    try:
        ckpt = await scoped.get_checkpoint(conn, who, run, SAMPLER_KIND, name)
    except NotFound:
        raise NotFound(f"sampler weights {path} not found: not published yet (a save still running), deleted, "
                       f"or expired (anonymous snapshots expire {get_core_settings().anon_sampler_ttl_s} s "
                       f"after their last use)", field="model_path") from None
    if retention.due_to_slide(ckpt["expires_at"], ckpt["sliding_ttl_s"], datetime.now(UTC)):
        await conn.execute(
            "UPDATE checkpoints SET expires_at = now() + make_interval(secs => sliding_ttl_s) WHERE id = %s",
            (ckpt["id"],),
        )
    base = await _sampleable(conn, await _base_of_model(conn, run))
    return base, AdapterRef(key=ckpt["storage_path"], path=ckpt["storage_path"], model_id=run, name=name)


def _unsupported(body: SampleRequest) -> None:
    for field in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        if getattr(body, field):
            raise InvalidInput(f"{field} is not supported by this server yet; send 0", field=field)


@router.post("/asample")
async def asample(body: SampleRequest, who: Who, pool: Pool, redis: RedisDep, settings: Settings) -> dict:
    """Sample `num_samples` sequences (one group) from a sampler; a future with `sample_sequence_ids`.

    The result: `{"sequences": [{"tokens", "logprobs", "stop_reason", "model_id", "policy_version"}],
    "prompt_logprobs"?: [null, ...]}`.
    """
    gen = get_gen_pool_settings()
    _unsupported(body)
    if body.num_samples > gen.max_samples:
        raise InvalidInput(f"num_samples {body.num_samples} exceeds the limit of {gen.max_samples}",
                           field="num_samples")
    deadline_s = body.deadline_s or gen.default_deadline_s
    if deadline_s > gen.max_deadline_s:
        raise InvalidInput(f"deadline_s {deadline_s} exceeds the limit of {gen.max_deadline_s}", field="deadline_s")
    async with pool.connection() as conn:
        base, adapter = await _resolve(conn, who, body)
    limits = params.Limits(base.vocab_size, base.max_context_length, gen.max_samples, gen.max_new_tokens,
                           gen.default_max_tokens, gen.max_stop_entries, gen.max_stop_chars)
    prompt = params.check_prompt([t for c in body.prompt.chunks for t in c.tokens], limits)
    spec = params.normalise(body.sampling_params.model_dump(), len(prompt), limits)

    request_id = ids.new_request_id()
    dedupe = None
    if body.sampling_session_id is not None and body.seq_id is not None:
        # The SDK resubmits after timeouts and 5xx; the same (sampler, seq_id) is the same request.
        dedupe = f"quilt:sample-seq:{body.sampling_session_id}:{body.seq_id}"
        won = await redis.set(dedupe, f"{request_id}|{body.num_samples}", nx=True, ex=settings.future_ttl_seconds)
        if not won:
            existing = (await redis.get(dedupe) or b"").decode()
            if existing:
                rid, n = existing.split("|")
                return _future(rid, int(n))
    n_tokens = len(prompt) * body.num_samples
    now = time.time()
    try:
        async with pool.connection() as conn:
            await _admit(conn, who)
            await conn.execute(
                "INSERT INTO requests (id, tenant_id, api_key_id, model_id, seq_id, kind, n_tokens) "
                "VALUES (%s, %s, %s, %s, NULL, 'sample', %s)",
                (request_id, who.tenant_id, who.key_id, body.sampling_session_id, n_tokens),
            )
    except BaseException:
        if dedupe:
            await redis.delete(dedupe)
        raise
    work = {"prompt": prompt, "n": body.num_samples, "spec": spec.to_json(), "prompt_logprobs": body.prompt_logprobs,
            "prompt_logprobs_last_n": body.prompt_logprobs_last_n, "adapter": adapter.to_json() if adapter else None,
            "submitted_at": now, "deadline_at": now + deadline_s}
    item = queue.WorkItem(request_id=request_id, tenant_id=who.tenant_id, model_id=body.sampling_session_id or "",
                          seq_id=body.seq_id or 0, kind="sample", n_tokens=n_tokens, body=work)
    try:
        await queue.enqueue_sample(redis, base.name, item)
    except Exception:
        log.exception("could not enqueue %s", request_id)
        async with pool.connection() as conn:
            await conn.execute("UPDATE requests SET status = 'failed', finished_at = now() WHERE id = %s",
                               (request_id,))
        raise
    return _future(request_id, body.num_samples)


def _future(request_id: str, n: int) -> dict:
    return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{i}" for i in range(n)]}


@router.post("/cancel_future")
async def cancel_future(body: CancelFutureRequest, who: Who, pool: Pool, redis: RedisDep, settings: Settings) -> dict:
    """Abort a sampling request; its future fails with a `cancelled` user error. Finished: no-op."""
    async with pool.connection() as conn:
        row = await scoped.get_request(conn, who, body.request_id)
    if row["kind"] != "sample":
        raise InvalidInput(f"only sampling requests can be cancelled; {body.request_id!r} is a {row['kind']}",
                           field="request_id")
    if row["status"] not in ("done", "failed"):
        await redis.set(queue.cancel_key(body.request_id), b"1", ex=settings.future_ttl_seconds)
        await redis.publish(queue.CANCEL_CHANNEL, body.request_id)
    return {"type": "cancel_future", "request_id": body.request_id}
