"""TrainingClient: drives one LoRA model (forward/backward, optimizer steps, checkpoints).

Ordering: the server runs one model's requests in ``seq_id`` order. Each call reserves the next
``seq_id`` (1, 2, 3, ...; ``create_model`` was 0) and posts the request while holding a
per-model lock, so ids reach the server in the order the calls were made even when many
coroutines or threads share the client. Waiting happens outside the lock, which is what lets
``forward_backward`` and ``optim_step`` be submitted back to back and pipelined.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import quote

from ._loop import LoopThread
from ._transport import HTTPTransport
from .errors import APIStatusError
from .futures import APIFuture, require
from .sampling import SamplingClient
from .types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    OptimStepResult,
    TrainStepResult,
)

__all__ = ["TrainingClient"]

T = TypeVar("T")
Payload = dict[str, Any]


def _forward_payload(
    data: Sequence[Datum], loss_fn: str, loss_fn_config: dict[str, Any] | None, kind: str
) -> Payload:
    # Serialised in the caller's thread: big batches then don't stall the shared SDK loop,
    # and a bad datum fails where the user built it.
    datums = list(data)
    if not datums:
        raise ValueError(f"{kind} needs at least one Datum")
    for i, datum in enumerate(datums):
        if not isinstance(datum, Datum):
            raise TypeError(
                f"data[{i}] is a {type(datum).__name__}, not a quilt.Datum "
                "(build one with quilt.Datum(...) or quilt.datum_for_next_token(tokens))"
            )
    # tinker's names: ForwardRequest's `forward_input`, ForwardBackwardRequest's `forward_backward_input`.
    return {
        "forward_input" if kind == "forward" else "forward_backward_input": {
            "data": [datum.to_json() for datum in datums],
            "loss_fn": loss_fn,
            "loss_fn_config": dict(loss_fn_config) if loss_fn_config is not None else None,
        },
        "type": kind,
    }


def _optim_payload(adam: AdamParams) -> Payload:
    if not isinstance(adam, AdamParams):
        raise TypeError(f"adam must be a quilt.AdamParams, got {type(adam).__name__}")
    return {"adam_params": adam.to_json(), "type": "optim_step"}


def _saved_path(result: dict[str, Any]) -> str:
    return str(require(result, "path", "save_weights"))


def _nothing(result: dict[str, Any]) -> None:
    return None


def _metrics_payload(metrics: Mapping[str, float], step: int | None) -> Payload:
    # Checked here so a bad value fails where it was computed; the server checks the same rules.
    if not isinstance(metrics, Mapping) or not metrics:
        raise TypeError("metrics must be a non-empty dict of name -> float")
    values: dict[str, float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str):
            raise TypeError(f"metric names must be str, got {name!r}")
        if isinstance(value, (bool, str, bytes)):
            raise TypeError(f"metrics[{name!r}] must be a number, got {type(value).__name__}")
        if not isinstance(value, (int, float)):
            try:  # numpy and torch scalars
                value = float(value)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                raise TypeError(f"metrics[{name!r}] must be a number, got {type(value).__name__}") from None
        if not math.isfinite(value):
            raise ValueError(f"metrics[{name!r}] must be finite, got {value!r}")
        values[name] = float(value)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step must be an int >= 0 or None, got {step!r}")
    # One key per call, kept across the transport's retries: a retry after a lost answer does not
    # record the same point twice.
    return {"step": step, "metrics": values, "idempotency_key": uuid.uuid4().hex}


# Refusals after which the server has not used up the call's seq_id (the server's
# api.seq_gaps.SEQ_FREE_STATUSES; any other 4xx is recorded there as a failed request).
SEQ_FREE_STATUSES = frozenset({401, 408, 409, 413, 425, 429})


class TrainingClient:
    """Trains one LoRA model on the server; get one from ``Client.create_training_client``.

    Every method exists in a blocking form and an ``*_async`` form. Request methods return an
    :class:`~quilt.APIFuture` as soon as the server accepted the request; ``train_step`` waits
    and returns the finished :class:`~quilt.TrainStepResult`.

    Attributes:
        model_id: the server's id of this model (also the run id in ``tinker://`` paths).
    """

    def __init__(self, model_id: str, *, runner: LoopThread, http: HTTPTransport, owner: Any = None) -> None:
        """Internal: built by :class:`quilt.Client`; users never call this directly."""
        self.model_id = model_id
        self._runner = runner
        self._http = http
        self._owner = owner  # the quilt.Client: session-wide sampler ids and sampling sessions
        self._seq_lock = asyncio.Lock()
        self._last_seq_id = 0  # create_model holds seq_id 0

    def __repr__(self) -> str:
        return f"<TrainingClient model_id={self.model_id!r}>"

    async def _submit(
        self, name: str, payload: Payload, convert: Callable[[dict[str, Any]], T]
    ) -> APIFuture[T]:
        async with self._seq_lock:
            self._last_seq_id += 1
            body = {"model_id": self.model_id, "seq_id": self._last_seq_id, **payload}
            try:
                answer = await self._http.request("POST", name, body)
            except APIStatusError as exc:
                # The server records a final refusal (bad input, missing checkpoint, budget) at its
                # seq_id so later calls do not wait for it; these statuses leave the id unused, so
                # it is reused. After 5xx or connection errors the server may hold it, and reusing
                # it would be deduped into the old request.
                if exc.status_code in SEQ_FREE_STATUSES:
                    self._last_seq_id -= 1
                raise
        request_id = require(answer, "request_id", name)
        return APIFuture.poll(self._runner.submit, self._http, request_id, convert)

    async def _train_step(self, fb_payload: Payload, optim_payload: Payload) -> TrainStepResult:
        # Submit both before waiting on either: the server queues the optimizer step right
        # behind the gradients instead of idling for a round trip.
        fb = await self._submit("forward_backward", fb_payload, ForwardBackwardOutput.from_json)
        optim = await self._submit("optim_step", optim_payload, OptimStepResult.from_json)
        return TrainStepResult(forward_backward=await fb, optim=await optim)

    # -- get_info ------------------------------------------------------------------------

    def get_info(self) -> dict[str, Any]:
        """Describe the model (``model_data.model_name``, ``lora_rank``, ...) as the server sees it."""
        return self._runner.run(self._get_info())

    async def get_info_async(self) -> dict[str, Any]:
        """Async form of :meth:`get_info`."""
        return await self._runner.run_async(self._get_info())

    async def _get_info(self) -> dict[str, Any]:
        info = await self._http.request(
            "POST", "get_info", {"model_id": self.model_id, "type": "get_info"}
        )
        return dict(info)

    # -- metrics -------------------------------------------------------------------------

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Record named scalars for this run, e.g. ``{"reward_mean": 0.42}``; the dashboard plots
        each name against ``step`` beside the trainer's loss curve.

        ``step`` is the policy version the values belong to (the model's optimizer step count, the
        same x-axis as the loss); ``None`` uses the optimizer steps the server has completed. At
        most 64 names per call, each a finite number. Blocks until the server has stored them.
        """
        payload = _metrics_payload(metrics, step)
        self._runner.run(self._log_metrics(payload))

    async def log_metrics_async(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Async form of :meth:`log_metrics`."""
        payload = _metrics_payload(metrics, step)
        await self._runner.run_async(self._log_metrics(payload))

    async def _log_metrics(self, payload: Payload) -> None:
        await self._http.request("POST", f"quilt/models/{quote(self.model_id, safe=':')}/metrics", payload)

    # -- forward / backward --------------------------------------------------------------

    def forward_backward(
        self,
        data: Sequence[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, Any] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Compute the loss and accumulate gradients for ``data``.

        Gradients add up across calls until :meth:`optim_step`. ``loss_fn`` is one of the
        server's losses (``cross_entropy``, ``importance_sampling``, ``ppo``, ...), with
        ``loss_fn_config`` passed through verbatim.
        """
        payload = _forward_payload(data, loss_fn, loss_fn_config, "forward_backward")
        return self._runner.run(self._submit("forward_backward", payload, ForwardBackwardOutput.from_json))

    async def forward_backward_async(
        self,
        data: Sequence[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, Any] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Async form of :meth:`forward_backward` (returns the future once submitted)."""
        payload = _forward_payload(data, loss_fn, loss_fn_config, "forward_backward")
        return await self._runner.run_async(
            self._submit("forward_backward", payload, ForwardBackwardOutput.from_json)
        )

    def forward(
        self,
        data: Sequence[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, Any] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Compute the loss and per-token logprobs for ``data`` without touching gradients."""
        payload = _forward_payload(data, loss_fn, loss_fn_config, "forward")
        return self._runner.run(self._submit("forward", payload, ForwardBackwardOutput.from_json))

    async def forward_async(
        self,
        data: Sequence[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, Any] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Async form of :meth:`forward`."""
        payload = _forward_payload(data, loss_fn, loss_fn_config, "forward")
        return await self._runner.run_async(self._submit("forward", payload, ForwardBackwardOutput.from_json))

    # -- optimizer -----------------------------------------------------------------------

    def optim_step(self, adam: AdamParams) -> APIFuture[OptimStepResult]:
        """Apply one AdamW step with the gradients accumulated so far, then clear them."""
        payload = _optim_payload(adam)
        return self._runner.run(self._submit("optim_step", payload, OptimStepResult.from_json))

    async def optim_step_async(self, adam: AdamParams) -> APIFuture[OptimStepResult]:
        """Async form of :meth:`optim_step`."""
        payload = _optim_payload(adam)
        return await self._runner.run_async(self._submit("optim_step", payload, OptimStepResult.from_json))

    def train_step(
        self,
        data: Sequence[Datum],
        loss_fn: str = "cross_entropy",
        adam: AdamParams = AdamParams(),  # noqa: B008  (frozen, so one shared default is safe)
        loss_fn_config: dict[str, Any] | None = None,
    ) -> TrainStepResult:
        """One full step: ``forward_backward`` then ``optim_step``, submitted back to back.

        Blocks until both finish; ``result.loss`` is the summed loss of ``data``.
        """
        fb_payload = _forward_payload(data, loss_fn, loss_fn_config, "forward_backward")
        return self._runner.run(self._train_step(fb_payload, _optim_payload(adam)))

    async def train_step_async(
        self,
        data: Sequence[Datum],
        loss_fn: str = "cross_entropy",
        adam: AdamParams = AdamParams(),  # noqa: B008
        loss_fn_config: dict[str, Any] | None = None,
    ) -> TrainStepResult:
        """Async form of :meth:`train_step`."""
        fb_payload = _forward_payload(data, loss_fn, loss_fn_config, "forward_backward")
        return await self._runner.run_async(self._train_step(fb_payload, _optim_payload(adam)))

    # -- checkpoints ---------------------------------------------------------------------

    def save_state(self, name: str, *, overwrite: bool = False) -> APIFuture[str]:
        """Save weights and optimizer state under ``name``; resolves to its ``tinker://`` path.

        ``name`` must not contain ``/``. An existing name fails the future unless ``overwrite``.
        """
        return self._runner.run(self._submit("save_weights", _save_payload(name, overwrite), _saved_path))

    async def save_state_async(self, name: str, *, overwrite: bool = False) -> APIFuture[str]:
        """Async form of :meth:`save_state`."""
        return await self._runner.run_async(
            self._submit("save_weights", _save_payload(name, overwrite), _saved_path)
        )

    def load_state(self, path: str, *, optimizer: bool = True) -> APIFuture[None]:
        """Load a checkpoint saved by :meth:`save_state` (a ``tinker://`` path) into this model.

        With ``optimizer`` (the default) the Adam moments are restored too, so training resumes
        exactly; without it only the weights are loaded.
        """
        return self._runner.run(self._submit("load_weights", _load_payload(path, optimizer), _nothing))

    async def load_state_async(self, path: str, *, optimizer: bool = True) -> APIFuture[None]:
        """Async form of :meth:`load_state`."""
        return await self._runner.run_async(
            self._submit("load_weights", _load_payload(path, optimizer), _nothing)
        )

    # -- sampling ------------------------------------------------------------------------

    def save_weights_for_sampler(self, name: str) -> APIFuture[str]:
        """Publish the current weights for sampling as ``name``; resolves to their
        ``tinker://{model_id}/sampler_weights/{name}`` path.

        Publishing the same name again makes a new version of it; samplers created from the path
        afterwards sample the newest version, while sequences already running finish on theirs.
        """
        return self._runner.run(self._submit("save_weights_for_sampler", _sampler_payload(name), _saved_path))

    async def save_weights_for_sampler_async(self, name: str) -> APIFuture[str]:
        """Async form of :meth:`save_weights_for_sampler`."""
        return await self._runner.run_async(
            self._submit("save_weights_for_sampler", _sampler_payload(name), _saved_path)
        )

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> SamplingClient:
        """Publish the current weights and return a SamplingClient bound to exactly them.

        Without ``name`` the weights are published anonymously (a snapshot: later training steps
        do not change what this client samples). Blocks until the weights are published.
        """
        return self._runner.run(self._save_and_get_sampler(name))

    async def save_weights_and_get_sampling_client_async(self, name: str | None = None) -> SamplingClient:
        """Async form of :meth:`save_weights_and_get_sampling_client`."""
        return await self._runner.run_async(self._save_and_get_sampler(name))

    async def _save_and_get_sampler(self, name: str | None) -> SamplingClient:
        if self._owner is None:
            raise RuntimeError("this TrainingClient was not made by a quilt.Client; it cannot open samplers")
        if name is not None:
            future = await self._submit("save_weights_for_sampler", _sampler_payload(name), _saved_path)
            return await self._owner._create_sampling_client(model_path=await future, base_model=None)
        payload = {"sampling_session_seq_id": self._owner._take_sampling_seq_id(), "kind": "snapshot",
                   "type": "save_weights_for_sampler"}
        result = await (await self._submit("save_weights_for_sampler", payload, dict))
        session_id = str(require(result, "sampling_session_id", "save_weights_for_sampler result"))
        info = await self._get_info()
        base_model = (info.get("model_data") or {}).get("model_name")
        version = result.get("policy_version")
        return SamplingClient(session_id, base_model=base_model, model_path=result.get("path"),
                              runner=self._runner, http=self._http,
                              policy_version=int(version) if version is not None else None)


def _sampler_payload(name: str) -> Payload:
    if not name or "/" in name:
        raise ValueError(f"sampler weights name must be non-empty and contain no '/', got {name!r}")
    return {"path": name, "kind": "snapshot", "type": "save_weights_for_sampler"}


def _save_payload(name: str, overwrite: bool) -> Payload:
    if not name or "/" in name:
        raise ValueError(f"checkpoint name must be non-empty and contain no '/', got {name!r}")
    return {"path": name, "overwrite": bool(overwrite), "type": "save_weights"}


def _load_payload(path: str, optimizer: bool) -> Payload:
    if not path:
        raise ValueError("load_state needs the tinker:// path returned by save_state")
    return {"path": path, "optimizer": bool(optimizer), "type": "load_weights"}
