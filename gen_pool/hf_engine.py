"""The trainer-side sampler: a generation engine over transformers, for the bases vLLM does not serve
here (bases.architectures.sampler_engine: a vision base, whose images Quilt hands vLLM no way to
take; Qwen3.5 where vLLM's model of it cannot be imported). It has GenEngine's methods (load,
generate, probe, abort, dead, shutdown and the adapter figures), so the scheduler, the worker, the
queue, billing and the futures are the same for both engines.

    engine = await HFEngine.start(model_path, settings, workdir)
    await engine.load(adapter_ref, in_use)              # checked, its factors read
    result = await engine.generate(SeqRequest(...))     # one sequence, images too on a vision base

How an adapter is applied: every sequence runs on one worker thread, one at a time, and before it
runs the weights its adapter wraps hold W + scaling * B @ A (checkpoints.adapter_merge's factors,
computed from the pristine W kept aside); weights the previous adapter wrapped and this one does not
get their W back. A tenant's adapter is therefore in the weights only while that tenant's own
sequence runs. The cost: one copy of each wrapped weight, and a merge when consecutive sequences use
different adapters (sequences of one group share theirs).

LoRA on a MoE base's experts (train_mlp=True; batcher.engine.expert_lora) is exported per expert
(`mlp.experts.{e}.gate_proj`, ...), while transformers keeps each block's experts fused
(`gate_up_proj` [E, 2I, H], gate rows then up rows; `down_proj` [E, H, I]): `fused_experts` stacks
the experts' factors onto the fused weight they change, which then merges and comes back like any
other (so a base with expert LoRA holds a copy of its experts while an adapter is in).

Which adapters stay read: the newest max_cpu_loras, and besides them every version an unfinished
group names (the scheduler's `in_use`), by the rule both engines share (gen_pool.adapters). With
more groups' distinct adapters queued than that, the cache runs over it until they finish, rather
than fail a queued group.

Logprobs are the raw model's (before temperature, top-k and top-p), as vLLM's: the logits transformers
returns at each step, log-softmaxed in float32. There is no prefix cache (every prompt token is
billed at the prefill rate) and a streamed sequence's tokens come in one piece, when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bases import architectures
from bases.memory_plan import resolve_dtype
from bases.vision import ImageProcessor, pretrained_class
from checkpoints import storage
from checkpoints.adapter_merge import Delta, fused_experts, lora_factors
from core.errors import NotFound, ServerError
from core.settings import GenPoolSettings
from core.work import AdapterRef, ImageInput
from gen_pool.adapters import AdapterError, check_adapter, newest, versions_to_forget
from gen_pool.engine import GREEDY_BELOW, ProbeRequest, SeqRequest, SeqResult, StopReason, TopK, no_groups
from gen_pool.routing import Recent

log = logging.getLogger("quilt.gen.hf_engine")

Adapter = tuple[str, dict[str, Delta]]  # a version's key and its factors, as a sequence carries them

ABORTED_KEPT = 4096  # ids of cancelled sequences remembered (one cancelled before it ran is never looked up)
class HFEngine:
    """One base in transformers, every tenant's adapter merged in only while its sequence runs."""

    def __init__(self, model: Any, tokenizer: Any, settings: GenPoolSettings, images: ImageProcessor | None,
                 eos: tuple[int, ...]) -> None:
        self.model, self.tokenizer, self.settings, self.images = model, tokenizer, settings, images
        self.eos = eos  # the base's end-of-sequence ids (its generation config's and its tokenizer's)
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.shapes = {name: tuple(p.shape) for name, p in self.params.items()}
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="hf-engine")  # one sequence at a time
        self._factors: OrderedDict[str, dict[str, Delta]] = OrderedDict()  # version key -> factors, LRU
        self._pristine: dict[str, Any] = {}  # weight name -> its base value, once an adapter has changed it
        self._merged: tuple[str | None, frozenset[str]] = (None, frozenset())  # the adapter in the weights
        self._aborted: OrderedDict[str, None] = OrderedDict()
        self._used = Recent(settings.max_cpu_loras)
        self.adapter_hits = self.adapter_misses = 0
        self.experts_refused = ""
        self._dead = False

    @classmethod
    async def start(cls, model_path: str, settings: GenPoolSettings, workdir: str | Path) -> HFEngine:
        started = time.monotonic()
        engine = await asyncio.to_thread(cls._load, str(model_path), settings)
        log.info("trainer-side sampler for %s started in %.1f s", model_path, time.monotonic() - started)
        return engine

    @classmethod
    def _load(cls, path: str, settings: GenPoolSettings) -> HFEngine:
        import torch
        from transformers import AutoTokenizer, GenerationConfig

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        arch = architectures.of_config(json.loads((Path(path) / "config.json").read_text()))
        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = getattr(torch, resolve_dtype(settings.dtype, device))
        model = pretrained_class(arch.vision).from_pretrained(path, dtype=dtype).to(device)
        model.eval().requires_grad_(False)
        tokenizer = AutoTokenizer.from_pretrained(path)
        own = model.generation_config.eos_token_id
        eos = {*(own if isinstance(own, list) else [own] if own is not None else []),
               *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])}
        # Every sampling setting is the request's: transformers would otherwise put the checkpoint's own
        # generation_config.json values (a top_p of 0.95, say) in place of a request's that equal its defaults.
        model.generation_config = GenerationConfig()
        return cls(model, tokenizer, settings, ImageProcessor(path) if arch.vision else None, tuple(sorted(eos)))

    # ------------------------------------------------------------------ adapters

    async def load(self, ref: AdapterRef, in_use: Callable[[], Collection[str]] = no_groups) -> None:
        """Make `ref` usable: its files checked and its factors read. QUILT_GEN_MAX_CPU_LORAS versions
        are kept, least recently used out, and besides them those unfinished groups name (`in_use`,
        the scheduler's), so a group queued behind newer versions finds its own."""
        if ref.key in self._factors:
            self.adapter_hits += 1
            self._factors.move_to_end(ref.key)
        else:
            self.adapter_misses += 1
        self._used.touch(ref.key)
        store = storage.get_store()
        path = store.local_dir(ref.path)
        with contextlib.suppress(NotFound):  # then check_adapter names what is missing
            path = await asyncio.to_thread(store.fetch, ref.path)
        if ref.key in self._factors:
            return
        check_adapter(path, max_rank=self.settings.max_lora_rank)
        factors = await asyncio.to_thread(self._read_factors, ref, Path(path))
        self._factors[ref.key] = factors
        if len(self._factors) > self.settings.max_cpu_loras:
            order = {key: i for i, key in enumerate(self._factors)}  # least recently used first
            for key in versions_to_forget(order, held=newest(order, self.settings.max_cpu_loras),
                                          in_use={ref.key, *in_use()}, asked_at=len(order)):
                del self._factors[key]

    def tracked_adapters(self) -> int:
        """Adapter versions whose factors are kept."""
        return len(self._factors)

    def _read_factors(self, ref: AdapterRef, path: Path) -> dict[str, Delta]:
        try:
            factors = fused_experts(lora_factors(path), self.shapes)
        except (OSError, ValueError, KeyError) as exc:
            raise AdapterError(f"adapter {ref.name or ref.key!r} cannot be loaded: {exc}", field="model_path") from None
        for name, f in factors.items():
            shape = self.shapes.get(name)
            if shape != tuple(f.shape):
                found = "no such weight" if shape is None else f"the weight is {shape}"
                raise AdapterError(f"adapter {ref.name or ref.key!r} wraps {name!r} {tuple(f.shape)}, which this base's "
                                   f"trainer-side sampler cannot apply ({found})", field="model_path")
        return factors

    def resident_adapters(self) -> list[str]:
        """The adapter versions whose factors are in memory (all of them are usable at once)."""
        return list(self._factors)

    def cached_adapters(self) -> list[str]:
        return list(self._used)

    def _merge(self, adapter: Adapter | None) -> None:
        """Put `adapter`'s weights in place (None: the base's). On the engine's thread only."""
        import torch

        key, factors = adapter or (None, {})
        if self._merged[0] == key:
            return
        with torch.no_grad():
            for name in self._merged[1] - factors.keys():
                self.params[name].copy_(self._pristine[name])
            for name, f in factors.items():
                param = self.params[name]
                base = self._pristine.setdefault(name, param.detach().clone())
                wide = torch.promote_types(param.dtype, torch.float32)
                param.copy_(base.to(wide) + f.delta(wide, param.device))
        self._merged = (key, frozenset(factors))

    async def _adapter_of(self, ref: AdapterRef | None) -> Adapter | None:
        """The factors a sequence runs with, taken now: a version dropped from the cache while the
        sequence waits for the engine's thread is still applied."""
        if ref is None:
            return None
        if ref.key not in self._factors:  # dropped since its group's load (a caller that named no groups in use)
            await self.load(ref)
        return ref.key, self._factors[ref.key]

    # ------------------------------------------------------------------ sequences

    async def generate(self, req: SeqRequest) -> SeqResult:
        """Run one sequence to its end. Cancelling the calling task aborts it (at its next token)."""
        adapter = await self._adapter_of(req.adapter)
        result: SeqResult = await self._on_thread(req.engine_id, self._generate, req, adapter, time.monotonic())
        if req.on_tokens is not None and result.tokens:  # on the loop: the worker's delta queue is not thread-safe
            req.on_tokens(result.tokens)
        return result

    async def probe(self, req: ProbeRequest) -> tuple[dict[int, float], tuple[tuple[int, float], ...]]:
        """One token after `req.prompt`: the raw logprobs of `req.ids`, and `req.draws` draws at its temperature."""
        adapter = await self._adapter_of(req.adapter)
        return await self._on_thread(req.engine_id, self._probe, req, adapter)

    async def _on_thread(self, engine_id: str, fn: Any, *args: Any) -> Any:
        future = asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)
        try:
            return await future
        except asyncio.CancelledError:
            self._aborted[engine_id] = None
            while len(self._aborted) > ABORTED_KEPT:
                self._aborted.popitem(last=False)
            raise
        except (AdapterError, ServerError):
            raise
        except Exception as exc:
            raise ServerError(f"the engine failed: {type(exc).__name__}: {exc}") from exc

    def _inputs(self, prompt: tuple[int, ...], images: tuple[ImageInput, ...]) -> dict[str, Any]:
        import torch

        device = self.model.device
        ids = torch.tensor([prompt], dtype=torch.long, device=device)
        out: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if images:
            if self.images is None:
                raise ServerError("images reached the sampler of a text-only base")
            made = [self.images.pixels(image) for image in images]
            out["pixel_values"] = torch.cat([p for p, _ in made]).to(device, self.model.dtype)
            out["image_grid_thw"] = torch.tensor([g for _, g in made], device=device)
            out["mm_token_type_ids"] = (ids == self.images.geometry.image_token_id).int()
        return out

    def _generate(self, req: SeqRequest, adapter: Adapter | None, submitted: float) -> SeqResult:
        import torch
        from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

        if self._aborted.pop(req.engine_id, 0) is None:
            return SeqResult((), (), "abort")
        self._merge(adapter)
        spec = req.spec
        inputs = self._inputs(req.prompt, req.images)
        prompt_lps = prompt_topk = None
        if req.prompt_logprobs:
            with torch.no_grad():
                logits = self.model(**inputs).logits[0].float()
            prompt_lps, prompt_topk = _prompt_scores(req.prompt, torch.log_softmax(logits, -1), req.prompt_topk)
        stops = tuple(spec.stop_token_ids) + (self.eos if spec.eos_stops else ())
        greedy = spec.temperature < GREEDY_BELOW
        config = GenerationConfig(
            max_new_tokens=spec.max_tokens, do_sample=not greedy, temperature=1.0 if greedy else spec.temperature,
            top_k=spec.top_k if spec.top_k >= 1 and not greedy else 0, top_p=1.0 if greedy else spec.top_p,
            eos_token_id=list(stops) or None, pad_token_id=stops[0] if stops else 0, stop_strings=list(spec.stop_strings)
            or None, output_logits=True, return_dict_in_generate=True, repetition_penalty=1.0)
        engine_id, aborted = req.engine_id, self._aborted

        class Aborted(StoppingCriteria):
            def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
                return torch.full((input_ids.shape[0],), engine_id in aborted, dtype=torch.bool, device=input_ids.device)

        torch.manual_seed(req.seed if req.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
        with torch.no_grad():
            out = self.model.generate(**inputs, generation_config=config, tokenizer=self.tokenizer,
                                      stopping_criteria=StoppingCriteriaList([Aborted()]))
        tokens = tuple(int(t) for t in out.sequences[0, len(req.prompt):])
        logprobs, sample_topk = [], []
        for tok, step in zip(tokens, out.logits):
            lps = torch.log_softmax(step[0].float(), -1)
            logprobs.append(float(lps[tok]))
            if req.sample_topk:
                sample_topk.append(_topk(lps, req.sample_topk))
        reason = self._stop_reason(req, tokens, stops)
        return SeqResult(tokens, tuple(logprobs), reason, prompt_lps, time.monotonic() - submitted, prompt_topk,
                         tuple(sample_topk) if req.sample_topk else None, 0)

    def _stop_reason(self, req: SeqRequest, tokens: tuple[int, ...], stops: tuple[int, ...]) -> StopReason:
        if self._aborted.pop(req.engine_id, 0) is None:
            return "abort"
        if tokens and tokens[-1] in stops:
            return "stop"
        if req.spec.stop_strings:
            tail = self.tokenizer.decode(list(tokens[-64:]))
            if any(tail.endswith(s) or s in tail for s in req.spec.stop_strings):
                return "stop"
        return "length" if len(tokens) >= req.spec.max_tokens else "stop"

    def _probe(self, req: ProbeRequest, adapter: Adapter | None) -> tuple[dict[int, float], tuple[tuple[int, float], ...]]:
        import torch

        self._merge(adapter)
        with torch.no_grad():
            logits = self.model(**self._inputs(req.prompt, ())).logits[0, -1].float()
        lps = torch.log_softmax(logits, -1)
        scores = {t: float(lps[t]) for t in req.ids}
        if not req.draws:
            return scores, ()
        if req.temperature < GREEDY_BELOW:
            best = int(lps.argmax())
            return scores, ((best, float(lps[best])),) * req.draws
        gen = torch.Generator(device=logits.device)
        gen.manual_seed(req.seed if req.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
        drawn = torch.multinomial(torch.softmax(logits / req.temperature, -1), req.draws, replacement=True, generator=gen)
        return scores, tuple((int(t), float(lps[t])) for t in drawn)

    async def abort(self, engine_ids: Iterable[str]) -> None:
        for engine_id in engine_ids:
            self._aborted[engine_id] = None

    @property
    def dead(self) -> bool:
        return self._dead

    def shutdown(self, *, grace_s: float | None = None) -> None:
        """Stop taking sequences; the one running finishes on its thread (nothing is saved)."""
        self._dead = True
        self._thread.shutdown(wait=False, cancel_futures=True)


def _topk(lps: Any, k: int) -> TopK:
    values, ids = lps.topk(k)
    return tuple((int(t), float(v)) for t, v in zip(ids, values))


def _prompt_scores(prompt: tuple[int, ...], lps: Any, k: int) -> tuple[tuple[float | None, ...],
                                                                        tuple[TopK | None, ...] | None]:
    """Each prompt token's logprob after the ones before it (None at position 0), and the k most
    likely tokens there when asked for."""
    own = (None, *(float(lps[i - 1, prompt[i]]) for i in range(1, len(prompt))))
    if not k:
        return own, None
    return own, (None, *(_topk(lps[i - 1], k) for i in range(1, len(prompt))))
