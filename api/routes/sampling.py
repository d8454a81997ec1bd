"""Sampling routes: publish adapter weights for sampling, sampling sessions, `asample`, cancellation.

    save_weights_for_sampler   a trainer request (seq_id order): named -> {"path"}; anonymous
                               (sampling_session_seq_id) -> {"sampling_session_id"} bound to it
    create_sampling_session    a sampler on one of your sampler_weights paths, or on a base model
    GET samplers/{id}          {"sampler_id", "base_model", "model_path"?}
    asample                    a future with `sample_sequence_ids`; compute_logprobs is an asample
                               with prompt_logprobs=true and max_tokens=1
    GET sampled_sequences/{id}/stability   a sequence's record_stability_info record
    cancel_future              aborts a sampling request (its future fails as cancelled)

Every publication is written to its own directory (`.../sampler_weights/<name>/<version>`), never
rewritten, so the generation pool can treat the directory as the adapter version's identity.
Anything that is not the caller's is 404, like a missing thing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from datetime import UTC, datetime

from fastapi import APIRouter, Request

from api import admission, images, records, seq_gaps
from api.deps import Pool, RedisDep, Settings, Who
from api.input_guard import GuardedRoute
from api.schemas import (
    CancelFutureRequest,
    CreateSamplingSessionRequest,
    JoinSamplingSessionRequest,
    SampleRequest,
    SaveWeightsForSamplerRequest,
)
from bases import catalog
from checkpoints import retention
from checkpoints.layout import SAMPLER_KIND, new_version_dir
from core import db, ids, queue
from core.errors import InvalidInput, NotFound
from core.settings import get_core_settings, get_gen_pool_settings
from core.work import AdapterRef, SampleWork, SaveWeights, WorkItem, WorkKind
from gen_pool import outputs, params, stability
from tenancy import scoped

log = logging.getLogger("quilt.api.sampling")
router = APIRouter(route_class=GuardedRoute, tags=["sampling"])

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


def _weights_base(base_name: str, base_model: str | None, model_path: str) -> str:
    """The base of sampler weights `model_path` (`base_name`), which a `base_model` named beside
    them must be: the weights decide what is sampled, and a contradiction is the client's mistake."""
    if base_model is not None and base_model != base_name:
        raise InvalidInput(f"base_model {base_model!r} is not the base of {model_path} ({base_name!r}); name "
                           f"{base_name!r} or leave base_model out", field="base_model")
    return base_name


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
    sampler_id = None
    async with pool.connection() as conn:
        model = await admission.usable_model(conn, who, body.model_id, seq_id=body.seq_id)
        if body.path is not None:
            name = body.path
        else:
            # Deterministic, so a retried submission names the same weights as the first one.
            name = f"anon-{body.seq_id}"
            sampler_id = f"{model['session_id']}:sample:{body.sampling_session_seq_id}"
            path = ids.tinker_path(body.model_id, SAMPLER_KIND, name)
            if not await records.insert_sampling_session(conn, who, sampler_id, session_id=model["session_id"],
                                                         seq_id=body.sampling_session_seq_id,
                                                         base_model=model["base_model"], model_id=body.model_id,
                                                         model_path=path):
                row = await scoped.get_sampling_session(conn, who, sampler_id)
                if row["model_path"] != path:
                    raise InvalidInput(f"sampling_session_seq_id {body.sampling_session_seq_id} is already used "
                                       f"by sampler {sampler_id!r}", field="sampling_session_seq_id")
        life = retention.lifetime(anonymous=body.path is None, ttl_seconds=body.ttl_seconds,
                                  anon_ttl_s=get_core_settings().anon_sampler_ttl_s)
        # A new directory per publication: the pool may still serve (and reload) the previous version.
        work = SaveWeights(name=name, overwrite=True, ttl_s=life.ttl_s, sliding=life.sliding,
                           sampling_session_id=sampler_id, user_metadata=body.user_metadata,
                           storage_path=new_version_dir(get_core_settings().checkpoint_dir, who.tenant_id,
                                                        body.model_id, SAMPLER_KIND, name))
        item = WorkItem(ids.new_request_id(), who.tenant_id, body.model_id, body.seq_id,
                        WorkKind.SAVE_WEIGHTS_FOR_SAMPLER, 0, work)
        request_id = await admission.admit(conn, redis, who, admission.Ticket(
            item, model["base_model"], admission.SeqSlot.of(model, body.seq_id)))
    return admission.future_response(request_id, body.model_id)


@router.post("/create_sampling_session")
async def create_sampling_session(body: CreateSamplingSessionRequest, who: Who, pool: Pool) -> dict:
    """A sampler on your sampler weights, or another tenant's published ones (`model_path`), or on a
    base model (`base_model`). Both
    may be given, as the tinker SDK sends them: the weights decide, and `base_model` must then be
    their base (400 naming it otherwise)."""
    sid = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
    async with pool.connection() as conn:
        session = await scoped.get_session(conn, who, body.session_id)
        if session["finished_at"] is not None:
            raise InvalidInput(f"session {body.session_id!r} has finished; create a new one", field="session_id")
        model_id = None
        if body.model_path is not None:
            run, name = _sampler_path(body.model_path)
            ckpt = await scoped.readable_checkpoint(conn, who, run, SAMPLER_KIND, name, field="model_path")
            base_name = _weights_base(ckpt["base_model"], body.base_model, body.model_path)
            model_id = run
        else:
            base_name = (await _sampleable(conn, body.base_model)).name
        await records.insert_sampling_session(conn, who, sid, session_id=body.session_id,
                                              seq_id=body.sampling_session_seq_id, base_model=base_name,
                                              model_id=model_id, model_path=body.model_path)
        row = await scoped.get_sampling_session(conn, who, sid)
    if row["model_path"] != body.model_path or row["base_model"] != base_name:
        raise InvalidInput(f"sampling_session_seq_id {body.sampling_session_seq_id} is already used by sampler "
                           f"{sid!r}", field="sampling_session_seq_id")
    return {"sampling_session_id": sid, "type": "create_sampling_session"}


@router.post("/join_sampling_session")
async def join_sampling_session(body: JoinSamplingSessionRequest, who: Who, pool: Pool) -> dict:
    """A number of its own for a copy of a sampling client (an unpickled tinker SamplingClient), so
    its request seq_ids (number * 10^9 + n) never collide with another copy's: 1 for the first
    copy, then 2, ...; the original client is 0."""
    async with pool.connection() as conn:
        clients = await scoped.join_sampling_session(conn, who, body.sampling_session_id)
    return {"type": "join_sampling_session", "client_counter": clients}


@router.get("/samplers/{sampling_session_id}")
async def get_sampler(sampling_session_id: str, who: Who, pool: Pool) -> dict:
    """Which base model (and which published weights, if any) a sampler samples."""
    async with pool.connection() as conn:
        return _sampler_json(await scoped.get_sampling_session(conn, who, sampling_session_id))


async def resolve(conn, who, *, sampling_session_id: str | None = None, model_path: str | None = None,
                  base_model: str | None = None) -> tuple[catalog.BaseModel, AdapterRef | None]:
    """What a sample request samples: the base, and the published adapter version (None: the base)."""
    path = model_path
    if sampling_session_id is not None:
        row = await scoped.get_sampling_session(conn, who, sampling_session_id)
        path, base_name = row["model_path"], row["base_model"]
    elif path is None:
        if base_model is None:
            raise InvalidInput("give sampling_session_id, model_path or base_model", field="sampling_session_id")
        base_name = base_model
    if path is None:
        return await _sampleable(conn, base_name), None
    run, name = _sampler_path(path)
    try:
        ckpt = await scoped.readable_checkpoint(conn, who, run, SAMPLER_KIND, name)
    except NotFound:
        raise NotFound(f"sampler weights {path} not found: not saved yet (a save still running), deleted, "
                       "unpublished by their owner, "
                       f"or expired (anonymous snapshots expire {get_core_settings().anon_sampler_ttl_s} s "
                       f"after their last use)", field="model_path") from None
    base = await _sampleable(conn, ckpt["base_model"])
    if model_path is not None:
        _weights_base(base.name, base_model, model_path)
    if retention.due_to_slide(ckpt["expires_at"], ckpt["sliding_ttl_s"], datetime.now(UTC),
                              by_owner=ckpt["tenant_id"] == who.tenant_id):
        await records.slide_checkpoint(conn, ckpt["id"])
    return base, AdapterRef(key=ckpt["storage_path"], path=ckpt["storage_path"], model_id=run, name=name)


def check_group(*, n: int, n_field: str, topk: int, topk_field: str) -> None:
    """Refuse a sample group larger than the pool takes, or a top-k past the engine's (asample and
    the OpenAI routes, before anything is looked up)."""
    gen = get_gen_pool_settings()
    if not 0 <= topk <= gen.max_topk_logprobs:
        raise InvalidInput(f"{topk_field} must be in [0, {gen.max_topk_logprobs}], got {topk}", field=topk_field)
    if n > gen.max_samples:
        raise InvalidInput(f"{n_field} {n} exceeds the limit of {gen.max_samples}", field=n_field)


def group_limits(base: catalog.BaseModel) -> params.Limits:
    """What a group's prompt and sampling params are checked against on `base`."""
    gen = get_gen_pool_settings()
    return params.Limits(base.vocab_size, base.max_context_length, gen.max_samples, gen.max_new_tokens,
                         gen.default_max_tokens, gen.max_stop_entries, gen.max_stop_chars)


def _outputs(body: SampleRequest, prompt_len: int, vocab: int) -> tuple[outputs.PromptTargets | None, int]:
    """Check the extra outputs a request asks for; returns its parsed targets and how many prompt rows
    its probes score (gen_pool.outputs)."""
    gen = get_gen_pool_settings()
    if not 0 <= body.topk_sample_logprobs <= gen.max_topk_logprobs:
        raise InvalidInput(f"topk_sample_logprobs must be in [0, {gen.max_topk_logprobs}], got "
                           f"{body.topk_sample_logprobs}", field="topk_sample_logprobs")
    if not 0 <= body.prompt_alt_tokens_k <= gen.max_alt_tokens:
        raise InvalidInput(f"prompt_alt_tokens_k must be in [0, {gen.max_alt_tokens}], got {body.prompt_alt_tokens_k}",
                           field="prompt_alt_tokens_k")
    alt_rows = prompt_len - 1 if body.prompt_alt_tokens_k else 0
    if alt_rows > gen.max_probe_rows:
        raise InvalidInput(f"prompt_alt_tokens_k draws at every prompt position: {alt_rows} rows, more than the limit "
                           f"of {gen.max_probe_rows} (QUILT_GEN_MAX_PROBE_ROWS); shorten the prompt",
                           field="prompt_alt_tokens_k")
    targets = None
    if body.target_prompt_logprobs is not None:
        targets = outputs.parse_targets(body.target_prompt_logprobs, prompt_len=prompt_len, vocab=vocab,
                                        max_rows=gen.max_probe_rows)
    return targets, len(outputs.probe_rows(targets, alt_rows)) if targets is not None or alt_rows else 0


@router.post("/asample")
async def asample(body: SampleRequest, who: Who, pool: Pool, redis: RedisDep, settings: Settings) -> dict:
    """Sample `num_samples` sequences (one group) from a sampler; a future with `sample_sequence_ids`.

    The result: `{"sequences": [{"tokens", "logprobs", "stop_reason", "model_id", "policy_version"}],
    "prompt_logprobs"?: [null, ...], "topk_prompt_logprobs"?: [null, [[token, logprob], ...], ...]}`;
    `topk_prompt_logprobs=k` gives the k most likely tokens at every prompt position (at most
    QUILT_GEN_MAX_TOPK_LOGPROBS), `prompt_logprobs_last_n` limits both to the prompt's last n;
    `topk_sample_logprobs=k` gives them at every sampled position (each sequence's "topk_logprobs");
    `target_prompt_logprobs` (int64 `[len(prompt) - 1, K]`, dense or CSR, -1: nothing) gives the
    logprobs of the named ids in the same layout; `prompt_alt_tokens_k=k` gives k draws at the
    request's temperature at every prompt position after the first ("prompt_alt_tokens");
    `record_stability_info` keeps each sequence's record (GET sampled_sequences/{id}/stability).
    """
    gen = get_gen_pool_settings()
    check_group(n=body.num_samples, n_field="num_samples", topk=body.topk_prompt_logprobs,
                topk_field="topk_prompt_logprobs")
    deadline_s = body.deadline_s or gen.default_deadline_s
    if deadline_s > gen.max_deadline_s:
        raise InvalidInput(f"deadline_s {deadline_s} exceeds the limit of {gen.max_deadline_s}", field="deadline_s")
    async with db.autocommit(pool) as conn:  # one row written: no transaction (admission)
        base, adapter = await resolve(conn, who, sampling_session_id=body.sampling_session_id,
                                      model_path=body.model_path, base_model=body.base_model)
        limits = group_limits(base)
        tokens, image_inputs = await asyncio.to_thread(images.sample_prompt, body.prompt, base, settings, who.tenant_id)
        prompt = params.check_prompt(tokens, limits)
        spec = params.normalise(body.sampling_params.model_dump(), len(prompt), limits)
        targets, probe_rows = _outputs(body, len(prompt), base.vocab_size)
        if image_inputs and probe_rows:  # a probe scores a prefix of the prompt, which may cut an image
            raise InvalidInput("target_prompt_logprobs and prompt_alt_tokens_k are not served for prompts with images",
                               field="target_prompt_logprobs" if body.target_prompt_logprobs is not None
                               else "prompt_alt_tokens_k")
        now = time.time()
        work = SampleWork(prompt=tuple(prompt), n=body.num_samples, spec=spec, adapter=adapter, submitted_at=now,
                          deadline_at=now + deadline_s, prompt_logprobs=body.prompt_logprobs,
                          prompt_logprobs_last_n=body.prompt_logprobs_last_n,
                          prompt_topk=body.topk_prompt_logprobs, sample_topk=body.topk_sample_logprobs,
                          prompt_targets=None if targets is None else targets.to_json(),
                          prompt_alt_k=body.prompt_alt_tokens_k, record_stability=bool(body.record_stability_info),
                          episode_id=body.episode_id,
                          episode_hint=body.episode_hint, images=image_inputs)
        item = WorkItem(ids.new_request_id(), who.tenant_id, body.sampling_session_id or "", body.seq_id or 0,
                        WorkKind.SAMPLE, len(prompt) * body.num_samples, work)
        slot = None
        if body.sampling_session_id is not None and body.seq_id is not None:
            # The SDK resubmits after timeouts and 5xx; the same (sampler, seq_id) is the same request.
            slot = admission.RedisSlot(f"quilt:sample-seq:{body.sampling_session_id}:{body.seq_id}",
                                       settings.future_ttl_seconds)
        # Rate-limited on what it may consume: its prompts, every sample's max_tokens, and each probe's
        # token (and draws) besides (gen_pool.outputs).
        rate_tokens = body.num_samples * (len(prompt) + spec.max_tokens) + probe_rows * max(body.prompt_alt_tokens_k, 1)
        request_id = await admission.admit(conn, redis, who, admission.Ticket(item, base.name, slot,
                                                                              rate_tokens=rate_tokens))
    return _future(request_id, body.num_samples)


def _future(request_id: str, n: int) -> dict:
    return {"request_id": request_id, "sample_sequence_ids": [stability.sequence_id(request_id, i) for i in range(n)]}


@router.get("/sampled_sequences/{sequence_id}/stability")
async def get_stability(sequence_id: str, who: Who, redis: RedisDep) -> dict:
    """Quilt: the stability record of one of your sampled sequences (asked for with
    `record_stability_info`): `{"sequence_id", "model_id", "policy_version", "prompt_length",
    "tokens", "logprobs", "stop_reason", "topk_logprobs"?}`. Reading it keeps it
    QUILT_GEN_STABILITY_TTL_S longer; a missing, expired or another tenant's record is 404."""
    if len(sequence_id) > 300:
        raise InvalidInput("sequence_id is longer than any this server gives (300 characters)", field="sequence_id")
    raw = await redis.getex(stability.key(who.tenant_id, sequence_id), ex=get_gen_pool_settings().stability_ttl_s)
    if raw is None:
        raise NotFound(f"no stability record for sequence {sequence_id!r}: not sampled with record_stability_info, "
                       "not finished yet, or expired", field="sequence_id")
    return json.loads(raw)


@router.post("/cancel_future")
async def cancel_future(body: CancelFutureRequest, who: Who, pool: Pool, redis: RedisDep, settings: Settings) -> dict:
    """Abort a sampling request; its future fails with a `cancelled` user error. Finished: no-op."""
    async with pool.connection() as conn:
        row = await scoped.get_request(conn, who, body.request_id)
    if row["kind"] != "sample":
        raise InvalidInput(f"only sampling requests can be cancelled; {body.request_id!r} is a {row['kind']}",
                           field="request_id")
    if row["status"] not in ("done", "failed"):
        await queue.request_cancel(redis, body.request_id, settings.future_ttl_seconds)
    return {"type": "cancel_future", "request_id": body.request_id}
