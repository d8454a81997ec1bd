"""Sampling: SamplingParams, sampled sequences, and the SamplingClient that asks for them.

A SamplingClient samples either a base model or one published version of your adapter weights
(``TrainingClient.save_weights_and_get_sampling_client()``). Each ``sample(prompt, n)`` call is one
group of ``n`` sequences that completes when all ``n`` have finished; every sequence carries the
``model_id`` and ``policy_version`` (optimizer steps) of the weights that produced it, and the
logprob of every sampled token.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._loop import LoopThread
from ._transport import HTTPTransport
from .futures import APIFuture, SessionPoller, require
from .types import ModelInput

__all__ = ["SampleResponse", "SampledSequence", "SamplingClient", "SamplingParams"]

StopSpec = str | Sequence[str] | Sequence[int] | None


@dataclass(frozen=True)
class SamplingParams:
    """How to sample.

    Attributes:
        max_tokens: most tokens to generate per sequence (None: the server's default).
        temperature: 0 is greedy; 1 samples the model's distribution.
        top_k: keep the k most likely tokens; -1 keeps all.
        top_p: nucleus sampling mass, in (0, 1].
        seed: makes sampling reproducible (sequence i of a group uses a seed derived from it).
        stop: ``None`` stops at the model's end-of-sequence token; a string, a list of strings or
            a list of token ids stops at those instead (the matched stop token is kept in the
            returned tokens); ``[]`` never stops before ``max_tokens``.
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: StopSpec = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")

    def to_json(self) -> dict[str, Any]:
        """The wire form (Tinker's ``SamplingParams``)."""
        body: dict[str, Any] = {"temperature": float(self.temperature), "top_k": int(self.top_k),
                                "top_p": float(self.top_p)}
        if self.max_tokens is not None:
            body["max_tokens"] = int(self.max_tokens)
        if self.seed is not None:
            body["seed"] = int(self.seed)
        if self.stop is not None:
            body["stop"] = self.stop if isinstance(self.stop, str) else list(self.stop)
        return body


@dataclass(frozen=True)
class SampledSequence:
    """One sampled sequence.

    Attributes:
        tokens: generated token ids (a matched stop token is the last one).
        logprobs: logprob of each generated token under the weights that sampled it.
        stop_reason: ``"stop"`` (a stop token or string, or EOS) or ``"length"`` (max_tokens).
        model_id: the training model whose weights sampled it (the base model's name for a base).
        policy_version: optimizer steps those weights had taken when published (0 for a base).
        sequence_id: the server's id for this sequence.
    """

    tokens: list[int]
    logprobs: list[float | None]
    stop_reason: str
    model_id: str | None = None
    policy_version: int | None = None
    sequence_id: str | None = None


@dataclass(frozen=True)
class SampleResponse:
    """Result of ``sample``: the group's sequences and, when asked for, the prompt's logprobs
    (``None`` at position 0, which nothing predicts)."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    #: with ``topk_prompt_logprobs=k``: per prompt position, the k most likely
    #: ``(token, logprob)``, most likely first (``None`` at position 0)
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], sequence_ids: Sequence[str] = ()) -> SampleResponse:
        """Parse the ``retrieve_future`` result; ``sequence_ids`` come from the submission."""
        seqs = []
        for i, s in enumerate(obj.get("sequences") or []):
            seqs.append(SampledSequence(
                tokens=[int(t) for t in s["tokens"]], logprobs=list(s.get("logprobs") or []),
                stop_reason=str(s.get("stop_reason")), model_id=s.get("model_id"),
                policy_version=s.get("policy_version"),
                sequence_id=sequence_ids[i] if i < len(sequence_ids) else None,
            ))
        plp = obj.get("prompt_logprobs")
        topk = obj.get("topk_prompt_logprobs")
        if topk is not None:
            topk = [None if row is None else [(int(t), lp) for t, lp in row] for row in topk]
        return cls(sequences=seqs, prompt_logprobs=list(plp) if plp is not None else None,
                   topk_prompt_logprobs=topk)


def _prompt_json(prompt: ModelInput | Sequence[int] | Any) -> dict[str, Any]:
    if not isinstance(prompt, ModelInput):
        prompt = ModelInput.from_ints(prompt)
    if prompt.length == 0:
        raise ValueError("prompt has no tokens")
    return prompt.to_json()


class SamplingClient:
    """Samples one base model or one published version of adapter weights.

    Get one from ``Client.create_sampling_client(...)`` or
    ``TrainingClient.save_weights_and_get_sampling_client()``. Request methods return an
    :class:`~quilt.APIFuture` as soon as the server accepted the request; each has an ``*_async``
    twin.

    Attributes:
        sampling_session_id: the server's id of this sampler.
        base_model: the base model it samples.
        model_path: the ``tinker://.../sampler_weights/...`` weights it samples (None for a base).
        policy_version: optimizer steps of those weights when they were published, where known
            (``TrainingClient.save_weights_and_get_sampling_client`` knows it; None otherwise).
    """

    def __init__(self, sampling_session_id: str, *, base_model: str | None, model_path: str | None,
                 runner: LoopThread, http: HTTPTransport, policy_version: int | None = None) -> None:
        """Internal: built by :class:`quilt.Client` and :class:`quilt.TrainingClient`."""
        self.sampling_session_id = sampling_session_id
        self.base_model = base_model
        self.model_path = model_path
        self.policy_version = policy_version
        self._runner = runner
        self._http = http
        self._seq_ids = itertools.count()  # dedupe key of resubmissions, not an order
        self._poller = SessionPoller(http, sampling_session_id)

    def __repr__(self) -> str:
        target = self.model_path or self.base_model
        return f"<SamplingClient {self.sampling_session_id!r} on {target!r}>"

    def _body(self, prompt: Any, num_samples: int, params: SamplingParams | None, prompt_logprobs: bool,
              deadline_s: float | None, topk_prompt_logprobs: int = 0, episode_id: str | None = None,
              episode_hint: str | None = None) -> dict[str, Any]:
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
        if not isinstance(topk_prompt_logprobs, int) or topk_prompt_logprobs < 0:
            raise ValueError(f"topk_prompt_logprobs must be a non-negative int, got {topk_prompt_logprobs!r}")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a quilt.SamplingParams, got {type(params).__name__}")
        body: dict[str, Any] = {
            "sampling_session_id": self.sampling_session_id, "seq_id": next(self._seq_ids),
            "num_samples": num_samples, "prompt": _prompt_json(prompt), "sampling_params": params.to_json(),
            "prompt_logprobs": bool(prompt_logprobs), "topk_prompt_logprobs": topk_prompt_logprobs, "topk_sample_logprobs": 0,
            "type": "sample",
        }
        if deadline_s is not None:
            body["deadline_s"] = float(deadline_s)
        if episode_hint is not None and episode_id is None:
            raise ValueError("episode_hint needs episode_id")
        if episode_id is not None:
            body["episode_id"] = str(episode_id)
        if episode_hint is not None:
            body["episode_hint"] = episode_hint
        return body

    async def _submit(self, body: dict[str, Any]) -> APIFuture[SampleResponse]:
        answer = await self._http.request("POST", "asample", body)
        request_id = require(answer, "request_id", "asample")
        sequence_ids = list(answer.get("sample_sequence_ids") or [])
        return APIFuture.poll(self._runner.submit, self._http, request_id,
                              lambda result: SampleResponse.from_json(result, sequence_ids), cancellable=True,
                              poller=self._poller)

    def sample(self, prompt: ModelInput | Sequence[int], num_samples: int = 1,
               sampling_params: SamplingParams | None = None, *, include_prompt_logprobs: bool = False,
               topk_prompt_logprobs: int = 0, deadline_s: float | None = None, episode_id: str | None = None,
               episode_hint: str | None = None) -> APIFuture[SampleResponse]:
        """Sample ``num_samples`` continuations of ``prompt`` (one group).

        Args:
            prompt: token ids, or a :class:`quilt.ModelInput`.
            num_samples: sequences in the group; the future resolves when all have finished.
            sampling_params: a :class:`quilt.SamplingParams` (defaults: temperature 1, EOS stops).
            include_prompt_logprobs: also return the logprob of every prompt token.
            topk_prompt_logprobs: also return the ``k`` most likely tokens and their logprobs at
                every prompt position (``SampleResponse.topk_prompt_logprobs``).
            deadline_s: fail the request (aborting its sequences) if it is not done this many
                seconds after submission.
            episode_id: the multi-turn episode this call is a turn of (1-128 of letters, digits,
                ``._:/-``). The pool serves episodes that have consumed fewer tokens first, so
                short episodes are not stuck behind the long tail; quilt.rl sends one per group.
            episode_hint: ``"promote"`` (the episode is about to end, say its tool returned the
                final answer) or ``"demote"`` (say a retry loop began) moves the episode one level.
        """
        body = self._body(prompt, num_samples, sampling_params, include_prompt_logprobs, deadline_s,
                          topk_prompt_logprobs, episode_id, episode_hint)
        return self._runner.run(self._submit(body))

    async def sample_async(self, prompt: ModelInput | Sequence[int], num_samples: int = 1,
                           sampling_params: SamplingParams | None = None, *,
                           include_prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0,
                           deadline_s: float | None = None, episode_id: str | None = None,
                           episode_hint: str | None = None) -> APIFuture[SampleResponse]:
        """Async form of :meth:`sample` (returns the future once submitted)."""
        body = self._body(prompt, num_samples, sampling_params, include_prompt_logprobs, deadline_s,
                          topk_prompt_logprobs, episode_id, episode_hint)
        return await self._runner.run_async(self._submit(body))

    async def _logprobs(self, prompt: Any) -> APIFuture[list[float | None]]:
        body = self._body(prompt, 1, SamplingParams(max_tokens=1), True, None)
        answer = await self._http.request("POST", "asample", body)
        request_id = require(answer, "request_id", "asample")
        return APIFuture.poll(self._runner.submit, self._http, request_id,
                              lambda result: list(SampleResponse.from_json(result).prompt_logprobs or []),
                              poller=self._poller)

    def compute_logprobs(self, prompt: ModelInput | Sequence[int]) -> APIFuture[list[float | None]]:
        """The logprob of every token of ``prompt`` given the ones before it (``None`` first)."""
        return self._runner.run(self._logprobs(prompt))

    async def compute_logprobs_async(self, prompt: ModelInput | Sequence[int]) -> APIFuture[list[float | None]]:
        """Async form of :meth:`compute_logprobs`."""
        return await self._runner.run_async(self._logprobs(prompt))
