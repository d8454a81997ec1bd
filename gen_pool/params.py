"""Sampling parameters checked at the edge: a Tinker `SamplingParams` into the `core.work.SamplingSpec`
that travels to the engine (raising InvalidInput that names the field and the limit); the worker
turns it into vLLM's SamplingParams (gen_pool.engine). Pure and import-light: the API imports this
module without vLLM.

Stop semantics (Tinker): `stop` absent/None keeps the model's EOS as the only stop; `stop=[]` stops
on nothing (always `max_tokens` tokens); a list of strings or of token ids stops on those *instead*
of EOS. A matched stop token is part of the returned tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.errors import InvalidInput
from core.work import SEED_MAX, SamplingSpec


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_context_length: int
    max_samples: int
    max_new_tokens: int
    default_max_tokens: int
    max_stop_entries: int
    max_stop_chars: int


def check_prompt(tokens: list, limits: Limits, *, field: str = "prompt") -> list[int]:
    if not tokens:
        raise InvalidInput(f"{field} has no tokens; send at least one", field=field)
    out = []
    for i, t in enumerate(tokens):
        # is_integer() first: int() of NaN or Infinity raises instead of answering.
        if isinstance(t, bool) or not isinstance(t, (int, float)) or (isinstance(t, float) and not t.is_integer()):
            raise InvalidInput(f"{field} token {i} is {t!r}, not an integer token id", field=field)
        t = int(t)
        if not 0 <= t < limits.vocab_size:
            raise InvalidInput(f"{field} token {i} is {t}, outside the vocabulary [0, {limits.vocab_size})",
                               field=field)
        out.append(t)
    if len(out) >= limits.max_context_length:
        raise InvalidInput(f"{field} has {len(out)} tokens; the model's context is {limits.max_context_length}",
                           field=field)
    return out


def normalise(raw: dict[str, Any], prompt_len: int, limits: Limits) -> SamplingSpec:
    """Validate a Tinker SamplingParams dict (already type-checked by the schema) into a spec."""
    f = "sampling_params"
    max_tokens = raw.get("max_tokens")
    room = limits.max_context_length - prompt_len
    if max_tokens is None:
        max_tokens = min(limits.default_max_tokens, room)
    if max_tokens < 1:
        raise InvalidInput(f"{f}.max_tokens must be >= 1, got {max_tokens}", field=f"{f}.max_tokens")
    if max_tokens > limits.max_new_tokens:
        raise InvalidInput(f"{f}.max_tokens {max_tokens} exceeds the limit of {limits.max_new_tokens}",
                           field=f"{f}.max_tokens")
    if max_tokens > room:
        raise InvalidInput(f"{f}.max_tokens {max_tokens} plus the prompt's {prompt_len} tokens exceeds the "
                           f"model's context of {limits.max_context_length}", field=f"{f}.max_tokens")
    temperature = float(raw.get("temperature", 1.0))
    if not 0.0 <= temperature <= 100.0:
        raise InvalidInput(f"{f}.temperature must be in [0, 100], got {temperature}", field=f"{f}.temperature")
    top_k = int(raw.get("top_k", -1))
    if top_k == 0 or top_k < -1:
        raise InvalidInput(f"{f}.top_k must be -1 (off) or >= 1, got {top_k}", field=f"{f}.top_k")
    if top_k > limits.vocab_size:
        top_k = -1  # keeping more tokens than exist is no restriction
    top_p = float(raw.get("top_p", 1.0))
    if not 0.0 < top_p <= 1.0:
        raise InvalidInput(f"{f}.top_p must be in (0, 1], got {top_p}", field=f"{f}.top_p")
    seed = raw.get("seed")
    if seed is not None and not 0 <= seed <= SEED_MAX:
        raise InvalidInput(f"{f}.seed must be in [0, 2**63-1], got {seed}", field=f"{f}.seed")
    strings, token_ids, eos_stops = _stops(raw.get("stop"), limits)
    return SamplingSpec(max_tokens=int(max_tokens), temperature=temperature, top_k=top_k, top_p=top_p,
                        seed=seed, stop_strings=strings, stop_token_ids=token_ids, eos_stops=eos_stops)


def _stops(stop: Any, limits: Limits) -> tuple[tuple[str, ...], tuple[int, ...], bool]:
    f = "sampling_params.stop"
    if stop is None:
        return (), (), True
    if isinstance(stop, str):
        stop = [stop]
    if len(stop) > limits.max_stop_entries:
        raise InvalidInput(f"{f} has {len(stop)} entries; the limit is {limits.max_stop_entries}", field=f)
    if all(isinstance(s, str) for s in stop):
        for s in stop:
            if not 0 < len(s) <= limits.max_stop_chars:
                raise InvalidInput(f"{f} strings must have 1 to {limits.max_stop_chars} characters", field=f)
        return tuple(stop), (), False
    if all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
        for s in stop:
            if not 0 <= s < limits.vocab_size:
                raise InvalidInput(f"{f} token id {s} is outside the vocabulary [0, {limits.vocab_size})", field=f)
        return (), tuple(stop), False
    raise InvalidInput(f"{f} must be a string, a list of strings or a list of token ids, not a mix", field=f)
