"""OpenAI-compatible inference: `POST /v1/completions` and `POST /v1/chat/completions`, so
evaluation tools that speak the OpenAI API score a trained policy on the engine and precision it
was sampled with.

`model` names sampler weights of yours (`tinker://<run>/sampler_weights/<name>`) or a base model;
the API key comes as `Authorization: Bearer` (or `X-API-Key`). A request is one sample group
(`n` choices) through the same admission as `asample`: quotas, rate limits, budgets, metering and
isolation are the same, and another tenant's weights are a 404. Text goes through the base's own
tokenizer here; chat messages through its chat template (or the catalogue's renderer,
api.chat_render).

Text is bounded before it is tokenized (MAX_CHARS_PER_TOKEN characters per token of the base's
context), tokenized in a thread with no database connection held, and a caller who leaves stops
the work: a non-streamed wait notices within WAIT_SLICE_S, a stream at once, and the request is
cancelled (its tokens stop being sampled). A non-streamed wait counts as one of the tenant's
long-polls (api.long_polls).

`stream: true` answers Server-Sent Events in OpenAI's chunk format as tokens are sampled: the
generation worker publishes each engine step's new tokens (core.queue.delta_key) and this route
decodes them into text chunks (holding back a partial UTF-8 character), then the finish reasons
and `[DONE]`. The text of a stream equals the text of the same request unstreamed.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import anyio
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from api import admission, chat_render, long_polls
from api.deps import Pool, RedisDep, Settings, Who
from api.input_guard import GuardedRoute
from api.routes.sampling import check_group, group_limits, resolve
from bases import catalog
from core import db, ids, queue
from core.errors import InvalidInput, NotFound, QuiltError, ServerError
from core.numbers import INT32_MAX
from core.settings import get_gen_pool_settings
from core.work import SampleWork, WorkItem, WorkKind
from gen_pool import params

router = APIRouter(prefix="/v1", route_class=GuardedRoute, tags=["openai"])

Text = Annotated[str, Field(max_length=1_000_000)]
# A prompt longer than this many characters per token of the base's context cannot fit it (tokens
# of real tokenizers average 3 to 5 characters, runs of spaces reach 16 or so): refused unread.
MAX_CHARS_PER_TOKEN = 32
WAIT_SLICE_S = 2.0  # a non-streamed wait checks this often whether its caller is still there


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields a sampler has no use for

    model: str = Field(max_length=1024)
    max_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    temperature: float = Field(1.0, ge=0, le=1e6, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    n: int = Field(1, ge=1, le=INT32_MAX)
    stop: Text | list[Text] | None = Field(None)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    logprobs: Any = None


class CompletionRequest(_Common):
    prompt: Text | list[int] = Field(description="text, or token ids")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=INT32_MAX)


class ChatPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer"]
    content: Text | list[ChatPart]


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(None, ge=0, le=INT32_MAX)


@functools.lru_cache(maxsize=8)
def _tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _refuse_unsupported(body: _Common) -> None:
    if isinstance(body, CompletionRequest):
        if body.logprobs and not body.echo:
            raise InvalidInput("logprobs > 0 needs echo=true: top alternatives are given for prompt tokens, not "
                               "for sampled ones (logprobs=0 gives the sampled tokens' logprobs)", field="logprobs")
        if body.max_tokens == 0 and not body.echo:
            raise InvalidInput("max_tokens must be >= 1 (0 only with echo=true, to score the prompt)",
                               field="max_tokens")
        if body.stream and (body.echo or body.logprobs is not None):
            raise InvalidInput("echo and logprobs are not streamed; send stream=false", field="stream")
    else:
        if body.logprobs not in (None, False):
            raise InvalidInput("logprobs is not supported on chat completions; use /v1/completions with echo=true "
                               "or /api/v1/asample", field="logprobs")
        if 0 in (body.max_tokens, body.max_completion_tokens):
            field = "max_tokens" if body.max_tokens == 0 else "max_completion_tokens"
            raise InvalidInput(f"{field} must be >= 1", field=field)


async def _target(conn, who, model: str):
    try:
        if model.startswith("tinker://"):
            return await resolve(conn, who, model_path=model)
        return await resolve(conn, who, base_model=model)
    except QuiltError as exc:
        raise type(exc)(exc.message, field="model") from None


@dataclass
class _Admitted:
    base: catalog.BaseModel
    prompt: list[int]
    request_id: str
    n: int


async def _admit(who, pool, redis, body: _Common, prompt_of, text_chars: int) -> _Admitted:
    """Admit one group for `body` (asample's admission). `text_chars`: the characters the prompt's
    text holds, bounded before anything is tokenized."""
    _refuse_unsupported(body)
    scored = isinstance(body, CompletionRequest) and body.echo
    topk = (body.logprobs or 0) if scored else 0
    check_group(n=body.n, n_field="n", topk=topk, topk_field="logprobs")
    gen = get_gen_pool_settings()
    async with db.autocommit(pool) as conn:
        base, adapter = await _target(conn, who, body.model)
    field = "messages" if isinstance(body, ChatRequest) else "prompt"
    most = MAX_CHARS_PER_TOKEN * base.max_context_length
    if text_chars > most:
        raise InvalidInput(f"{field}: {text_chars:,} characters cannot fit {base.name}'s context of "
                           f"{base.max_context_length:,} tokens; send at most {most:,}", field=field)
    # In a thread, holding no connection: a long prompt's tokenizing keeps no other caller waiting.
    tokenizer = await run_in_threadpool(_tokenizer, base.path)
    limits = group_limits(base)
    prompt = params.check_prompt(await run_in_threadpool(prompt_of, tokenizer, base), limits)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    # OpenAI's default is 16; 0 (with echo) scores the prompt: one token is sampled and dropped.
    max_tokens = 16 if max_tokens is None else max(max_tokens, 1)
    spec = params.normalise({"max_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p,
                             "seed": body.seed, "stop": stop}, len(prompt), limits)
    now = time.time()
    work = SampleWork(prompt=tuple(prompt), n=body.n, spec=spec, adapter=adapter, submitted_at=now,
                      deadline_at=now + gen.default_deadline_s, stream=body.stream,
                      prompt_logprobs=scored, prompt_topk=topk)
    item = WorkItem(ids.new_request_id(), who.tenant_id, "", 0, WorkKind.SAMPLE, len(prompt) * body.n, work)
    async with pool.connection() as conn:
        request_id = await admission.admit(conn, redis, who, admission.Ticket(
            item, base.name, None, rate_tokens=body.n * (len(prompt) + spec.max_tokens)))
    return _Admitted(base, prompt, request_id, body.n)


def _failure(outcome: queue.Outcome) -> QuiltError:
    err = outcome.error
    cls = InvalidInput if err.get("category") == "user" else ServerError
    return cls(err.get("error", "sampling failed"), request_id=outcome.request_id)


class _CallerLeft(Exception):
    """The caller of a non-streamed completion closed its connection while it waited."""


async def _result(request: Request, who, redis, settings, admitted: _Admitted) -> dict:
    """The group's result. Waits in slices, as one of the tenant's long-polls; a caller who leaves
    meanwhile has its request cancelled (_CallerLeft)."""
    outcome = None
    async with long_polls.held(who.tenant_id, settings.long_polls_per_tenant):
        while outcome is None:
            outcome = await queue.wait(redis, admitted.request_id, WAIT_SLICE_S)
            if outcome is None and await request.is_disconnected():
                await queue.request_cancel(redis, admitted.request_id, settings.future_ttl_seconds)
                raise _CallerLeft
    if not outcome.ok:
        raise _failure(outcome)
    return outcome.result


def _left() -> Response:
    """What a handler returns once its caller has gone: nobody reads it (499, as proxies log it)."""
    return Response(status_code=499)


class _Decoder:
    """Token ids -> the text they add, one sequence at a time; a partial UTF-8 character at the
    end waits for the token that completes it. Tokens come with their position in the sequence: a
    sequence sampled again from the start (its worker died and another re-ran it) repeats what was
    sent, which is skipped when it agrees; when it does not (an unseeded re-run), the text sent so
    far is not the result's and the sequence is marked `diverged`."""

    def __init__(self, tokenizer):
        self.tokenizer, self.tokens, self.sent, self.diverged = tokenizer, [], "", False

    def add(self, tokens, offset: int | None = None) -> str:
        tokens = list(tokens)
        if offset is not None and offset < len(self.tokens):
            known = self.tokens[offset:offset + len(tokens)]
            if tokens[:len(known)] != known:
                self.diverged = True
            tokens = tokens[len(known):]
        if self.diverged or not tokens:
            return ""
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(self.sent):
            return ""
        new, self.sent = text[len(self.sent):], text
        return new

    def finish(self, tokens) -> str:
        """What the final tokens add to what was sent (the final result is authoritative)."""
        text = self.tokenizer.decode(list(tokens), skip_special_tokens=True)
        new = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent = text
        return new


async def _stream(redis, settings, admitted: _Admitted, chunk_of) -> StreamingResponse:
    """SSE of `chunk_of(index, text, finish_reason)` as the pool samples, then `[DONE]`."""
    tokenizer = await run_in_threadpool(_tokenizer, admitted.base.path)
    key = queue.delta_key(admitted.request_id)

    def event(obj) -> str:
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

    async def events():
        decoders = [_Decoder(tokenizer) for _ in range(admitted.n)]
        last, outcome = "0-0", None
        try:
            while True:
                reply = await redis.xread({key: last}, count=256, block=200)
                for _stream_key, entries in reply or ():
                    for entry_id, fields in entries:
                        last = entry_id
                        i, offset = int(fields[b"i"]), fields.get(b"o")
                        text = await run_in_threadpool(decoders[i].add, json.loads(fields[b"t"]),
                                                       None if offset is None else int(offset))
                        if text:
                            yield event(chunk_of(i, text, None))
                if outcome is not None:
                    break
                outcome = await queue.ready(redis, admitted.request_id)  # once done, read what is left, then end
        finally:
            if outcome is None:  # the caller left mid-stream: stop sampling for nobody
                with anyio.CancelScope(shield=True):  # Starlette cancels the stream's scope when its caller leaves
                    await queue.request_cancel(redis, admitted.request_id, settings.future_ttl_seconds)
        if not outcome.ok:
            err = _failure(outcome)
            yield event({"error": {"message": err.message, "type": err.category, "request_id": err.request_id}})
        elif diverged := [i for i, d in enumerate(decoders) if d.diverged]:
            yield event({"error": {
                "message": f"the worker sampling this request stopped and another sampled choices {diverged} again "
                           "differently (no seed): the text streamed for them is not the result. The whole result "
                           f"is future {admitted.request_id} (POST /api/v1/retrieve_future); send a seed to make "
                           "a stream survive a worker's death", "type": "server", "request_id": admitted.request_id}})
        else:
            for i, seq in enumerate(outcome.result["sequences"]):
                rest = await run_in_threadpool(decoders[i].finish, seq["tokens"])
                if rest:
                    yield event(chunk_of(i, rest, None))
            for i, seq in enumerate(outcome.result["sequences"]):
                yield event(chunk_of(i, "", seq["stop_reason"]))
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-store"})


def _usage(prompt: list[int], result: dict) -> dict:
    done = sum(len(s["tokens"]) for s in result["sequences"])
    return {"prompt_tokens": len(prompt), "completion_tokens": done, "total_tokens": len(prompt) + done}


def _texts(base: catalog.BaseModel, result: dict) -> list[tuple[str, str]]:
    tokenizer = _tokenizer(base.path)
    return [(tokenizer.decode(s["tokens"], skip_special_tokens=True), s["stop_reason"]) for s in result["sequences"]]


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request, who: Who, pool: Pool, redis: RedisDep,
                      settings: Settings):
    """OpenAI text completion: `n` continuations of `prompt` (text or token ids)."""
    def prompt_of(tokenizer, _base):
        return body.prompt if isinstance(body.prompt, list) else tokenizer.encode(body.prompt)

    admitted = await _admit(who, pool, redis, body, prompt_of, 0 if isinstance(body.prompt, list) else len(body.prompt))
    head = {"id": f"cmpl-{admitted.request_id}", "created": int(time.time()), "model": body.model,
            "object": "text_completion"}
    if body.stream:
        return await _stream(redis, settings, admitted, lambda i, text, reason: {**head, "choices": [
            {"index": i, "text": text, "finish_reason": reason, "logprobs": None}]})
    try:
        result = await _result(request, who, redis, settings, admitted)
    except _CallerLeft:
        return _left()
    if body.echo or body.logprobs is not None:
        choices = await run_in_threadpool(_scored_choices, admitted, result, body)
    else:
        choices = [{"index": i, "text": text, "finish_reason": reason, "logprobs": None}
                   for i, (text, reason) in enumerate(_texts(admitted.base, result))]
    return JSONResponse({**head, "usage": _usage(admitted.prompt, result), "choices": choices})


def _scored_choices(admitted: _Admitted, result: dict, body: CompletionRequest) -> list[dict]:
    """Choices with OpenAI's completion `logprobs` (tokens, token_logprobs, top_logprobs,
    text_offset): over the prompt and the sample with `echo` (the prompt's first token has none,
    and with max_tokens=0 the sample is left out), over the sample alone otherwise. Top
    alternatives are the prompt's (topk_prompt_logprobs); a sampled token's entry is null."""
    tokenizer = _tokenizer(admitted.base.path)
    prompt = admitted.prompt
    piece = functools.lru_cache(maxsize=4096)(lambda t: tokenizer.decode([t]))
    out = []
    for i, seq in enumerate(result["sequences"]):
        sampled = [] if body.max_tokens == 0 else list(seq["tokens"])
        tokens, lps, tops = list(sampled), list(seq["logprobs"][:len(sampled)]), [None] * len(sampled)
        if body.echo:
            topk = result.get("topk_prompt_logprobs") or [None] * len(prompt)
            tokens = prompt + tokens
            lps = list(result.get("prompt_logprobs") or [None] * len(prompt)) + lps
            tops = [None if row is None or not body.logprobs else {piece(t): lp for t, lp in row} for row in topk] + tops
        strings = [piece(t) for t in tokens]
        offsets, at = [], 0
        for s in strings:
            offsets.append(at)
            at += len(s)
        text = tokenizer.decode(tokens, skip_special_tokens=True) if body.echo else \
            tokenizer.decode(sampled, skip_special_tokens=True)
        out.append({"index": i, "text": text, "finish_reason": seq["stop_reason"],
                    "logprobs": {"tokens": strings, "token_logprobs": lps, "top_logprobs": tops,
                                 "text_offset": offsets}})
    return out


def _message_text(message: ChatMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


@router.post("/chat/completions")
async def chat_completions(body: ChatRequest, request: Request, who: Who, pool: Pool, redis: RedisDep,
                           settings: Settings):
    """OpenAI chat completion: `n` assistant replies to `messages`, in the base's chat format."""
    messages = [("system" if m.role == "developer" else m.role, _message_text(m)) for m in body.messages]

    def prompt_of(tokenizer, base):
        if tokenizer.chat_template:
            return tokenizer.apply_chat_template([{"role": r, "content": t} for r, t in messages],
                                                 add_generation_prompt=True, tokenize=True, return_dict=False)
        return tokenizer.encode(chat_render.render(messages, base.renderer), add_special_tokens=False)

    admitted = await _admit(who, pool, redis, body, prompt_of, sum(len(t) for _, t in messages))
    head = {"id": f"chatcmpl-{admitted.request_id}", "created": int(time.time()), "model": body.model}
    if body.stream:
        return await _stream(redis, settings, admitted, lambda i, text, reason: {
            **head, "object": "chat.completion.chunk", "choices": [
                {"index": i, "delta": {"role": "assistant", "content": text} if text else {},
                 "finish_reason": reason}]})
    try:
        result = await _result(request, who, redis, settings, admitted)
    except _CallerLeft:
        return _left()
    texts = await run_in_threadpool(_texts, admitted.base, result)
    return JSONResponse({**head, "object": "chat.completion", "usage": _usage(admitted.prompt, result), "choices": [
        {"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
        for i, (text, reason) in enumerate(texts)]})


@router.get("/models")
async def models(who: Who, pool: Pool) -> dict:
    """The base models served for sampling (your sampler weights are addressed by tinker:// path)."""
    async with pool.connection() as conn:
        served = [m for m in await catalog.list_models(conn) if m.sampleable]
    if not served:
        raise NotFound("no base model is served for sampling here", field="model")
    return {"object": "list", "data": [{"id": m.name, "object": "model", "created": 0, "owned_by": "quilt"}
                                       for m in served]}
