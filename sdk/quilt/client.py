"""Client: the entry point. Holds the connection, the session and its heartbeat.

A session is opened lazily, by the first ``create_training_client``, and kept alive by a
heartbeat every 10 s until :meth:`Client.close`, which tells the server the session finished.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from types import TracebackType
from typing import Any

import httpx

from ._config import resolve_config
from ._loop import LoopThread
from ._transport import HTTPTransport
from ._version import __version__
from .billing import CostEstimate, UsageReport, estimate_body, usage_path
from .errors import APIStatusError, QuiltError
from .futures import require, retrieve_result
from .sampling import SamplingClient
from .training import TrainingClient

__all__ = ["Client"]

log = logging.getLogger("quilt")


class Client:
    """Connection to a Quilt server.

    Args:
        api_key: a ``tml-...`` key; defaults to the ``QUILT_API_KEY`` environment variable.
        base_url: server root, e.g. ``http://127.0.0.1:8000``; defaults to ``QUILT_BASE_URL``,
            then ``http://127.0.0.1:8000``.
        timeout: read timeout of ordinary requests, in seconds.
        transport: an ``httpx.AsyncBaseTransport`` to use instead of the network
            (``httpx.MockTransport`` in tests, a proxy-aware transport, ...).

    Use it as a context manager (``with quilt.Client() as client:``) or call :meth:`close`.
    """

    def __init__(
        self,
        api_key: str | None = None,
        base_url: str | None = None,
        *,
        timeout: float = 60.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._config = resolve_config(api_key, base_url, timeout)
        self._heartbeat_interval_s = self._config.heartbeat_interval_s
        self._runner = LoopThread()
        self._http: HTTPTransport = self._runner.run(_make_http(self._config, transport))
        self._session_lock = asyncio.Lock()
        self._session_id: str | None = None
        self._next_model_seq_id = 0
        self._next_sampling_seq_id = 0  # sampling_session_seq_id: one counter per session
        self._heartbeat: asyncio.Task[None] | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"<quilt.Client base_url={self._config.base_url!r} session_id={self._session_id!r}>"

    @property
    def base_url(self) -> str:
        """The server root this client talks to (no trailing slash)."""
        return self._config.base_url

    @property
    def session_id(self) -> str | None:
        """The server session, once the first training client opened it."""
        return self._session_id

    # -- simple reads --------------------------------------------------------------------

    def get_server_capabilities(self) -> dict[str, Any]:
        """What the server offers: ``{"supported_models": [{"model_name": ..., ...}]}``."""
        return self._runner.run(self._http.request("GET", "get_server_capabilities"))

    async def get_server_capabilities_async(self) -> dict[str, Any]:
        """Async form of :meth:`get_server_capabilities`."""
        return await self._runner.run_async(self._http.request("GET", "get_server_capabilities"))

    def healthz(self) -> dict[str, Any]:
        """The server's health report (raises if it is unreachable or unhealthy)."""
        return self._runner.run(self._http.request("GET", "healthz"))

    async def healthz_async(self) -> dict[str, Any]:
        """Async form of :meth:`healthz`."""
        return await self._runner.run_async(self._http.request("GET", "healthz"))

    # -- cost and usage ------------------------------------------------------------------

    def estimate_cost(
        self,
        base_model: str,
        steps: int = 1,
        *,
        prefill_tokens: int = 0,
        sample_tokens: int = 0,
        train_tokens: int = 0,
    ) -> CostEstimate:
        """Estimate what a planned run costs at today's prices, before running it.

        Args:
            base_model: a ``model_name`` from :meth:`get_server_capabilities`.
            steps: how many steps the run takes.
            prefill_tokens: prompt / forward-only tokens per step.
            sample_tokens: generated tokens per step.
            train_tokens: ``forward_backward`` model-input tokens per step.

        Returns a :class:`CostEstimate` (exact micro-USD and ``Decimal`` USD, per unit, and
        whether it fits in what is left of your monthly budget). Billing rounds per request,
        so the bill may differ by up to half a micro-USD per unit per request.
        """
        body = estimate_body(base_model, steps, prefill_tokens, sample_tokens, train_tokens)
        return CostEstimate.from_json(self._runner.run(self._http.request("POST", "quilt/estimate", body)))

    async def estimate_cost_async(
        self,
        base_model: str,
        steps: int = 1,
        *,
        prefill_tokens: int = 0,
        sample_tokens: int = 0,
        train_tokens: int = 0,
    ) -> CostEstimate:
        """Async form of :meth:`estimate_cost`."""
        body = estimate_body(base_model, steps, prefill_tokens, sample_tokens, train_tokens)
        answer = await self._runner.run_async(self._http.request("POST", "quilt/estimate", body))
        return CostEstimate.from_json(answer)

    def usage(self, since: datetime.date | str | None = None, until: datetime.date | str | None = None) -> UsageReport:
        """Your tenant's spend by day, by base model and by unit, with your budgets.

        Args:
            since: first UTC day (default: the 1st of this month).
            until: the day after the last one (default: tomorrow).
        """
        return UsageReport.from_json(self._runner.run(self._http.request("GET", usage_path(since, until))))

    async def usage_async(
        self, since: datetime.date | str | None = None, until: datetime.date | str | None = None
    ) -> UsageReport:
        """Async form of :meth:`usage`."""
        answer = await self._runner.run_async(self._http.request("GET", usage_path(since, until)))
        return UsageReport.from_json(answer)

    # -- training clients ----------------------------------------------------------------

    def create_training_client(
        self,
        base_model: str,
        rank: int = 16,
        *,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        seed: int | None = None,
        user_metadata: dict[str, Any] | None = None,
        max_context_length: int | None = None,
    ) -> TrainingClient:
        """Create a new LoRA model on ``base_model`` and return its TrainingClient.

        Args:
            base_model: a ``model_name`` from :meth:`get_server_capabilities`.
            rank: LoRA rank (> 0).
            train_mlp, train_attn, train_unembed: which layers get adapters (at least one).
            seed: seed for the adapter's initial weights; the server picks one if None.
            user_metadata: free-form JSON stored with the model (e.g. a run name).
            max_context_length: the longest datum the model takes, up to what the base and the
                server's memory plan allow; None: the server's standard context (docs/http-api.md).
                A longer context may be priced higher (docs/billing.md).

        Blocks until the server has created the model.
        """
        body = _create_model_body(base_model, rank, train_mlp, train_attn, train_unembed, seed, user_metadata,
                                  max_context_length)
        return self._runner.run(self._create_training_client(body))

    async def create_training_client_async(
        self,
        base_model: str,
        rank: int = 16,
        *,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        seed: int | None = None,
        user_metadata: dict[str, Any] | None = None,
        max_context_length: int | None = None,
    ) -> TrainingClient:
        """Async form of :meth:`create_training_client`."""
        body = _create_model_body(base_model, rank, train_mlp, train_attn, train_unembed, seed, user_metadata,
                                  max_context_length)
        return await self._runner.run_async(self._create_training_client(body))

    async def _create_training_client(self, body: dict[str, Any]) -> TrainingClient:
        async with self._session_lock:
            session_id = await self._ensure_session()
            # Held across the POST so model_seq_ids reach the server in order.
            body = {"session_id": session_id, "model_seq_id": self._next_model_seq_id, **body}
            self._next_model_seq_id += 1
            try:
                answer = await self._http.request("POST", "create_model", body)
            except APIStatusError as exc:
                # A 4xx proves no model was made under this id (ids name models; no order waits on them).
                if exc.status_code is not None and exc.status_code < 500:
                    self._next_model_seq_id -= 1
                raise
        request_id = require(answer, "request_id", "create_model")
        result = await retrieve_result(self._http, request_id)
        model_id = str(require(result, "model_id", "create_model result"))
        return TrainingClient(model_id, runner=self._runner, http=self._http, owner=self)

    # -- sampling clients ----------------------------------------------------------------

    def create_sampling_client(
        self, model_path: str | None = None, base_model: str | None = None
    ) -> SamplingClient:
        """A SamplingClient for published weights or for a base model (give exactly one).

        Args:
            model_path: a ``tinker://<model_id>/sampler_weights/<name>`` path of yours (from
                ``TrainingClient.save_weights_for_sampler``); the newest version of that name.
            base_model: a ``model_name`` from :meth:`get_server_capabilities`, sampled as is.
        """
        return self._runner.run(self._create_sampling_client(model_path=model_path, base_model=base_model))

    async def create_sampling_client_async(
        self, model_path: str | None = None, base_model: str | None = None
    ) -> SamplingClient:
        """Async form of :meth:`create_sampling_client`."""
        return await self._runner.run_async(
            self._create_sampling_client(model_path=model_path, base_model=base_model)
        )

    def _take_sampling_seq_id(self) -> int:
        # Runs on the SDK loop only, so the counter needs no lock.
        seq_id = self._next_sampling_seq_id
        self._next_sampling_seq_id += 1
        return seq_id

    async def _create_sampling_client(self, *, model_path: str | None, base_model: str | None) -> SamplingClient:
        if (model_path is None) == (base_model is None):
            raise ValueError("give exactly one of model_path= or base_model=")
        if model_path is not None and not model_path.startswith("tinker://"):
            raise ValueError(f"model_path must be a tinker:// path, got {model_path!r}")
        async with self._session_lock:
            session_id = await self._ensure_session()
        body: dict[str, Any] = {"session_id": session_id, "sampling_session_seq_id": self._take_sampling_seq_id(),
                                "type": "create_sampling_session"}
        body.update({"model_path": model_path} if model_path is not None else {"base_model": base_model})
        answer = await self._http.request("POST", "create_sampling_session", body)
        sampler_id = str(require(answer, "sampling_session_id", "create_sampling_session"))
        if model_path is not None:
            info = await self._http.request("GET", f"samplers/{sampler_id}")
            base_model = str(require(info, "base_model", "samplers"))
        return SamplingClient(sampler_id, base_model=base_model, model_path=model_path,
                              runner=self._runner, http=self._http)

    # -- session -------------------------------------------------------------------------

    async def _ensure_session(self) -> str:
        """Open the session on first use; the caller holds ``_session_lock``."""
        if self._session_id is not None:
            return self._session_id
        answer = await self._http.request(
            "POST",
            "create_session",
            {"tags": [], "user_metadata": {}, "sdk_version": __version__, "type": "create_session"},
        )
        self._session_id = str(require(answer, "session_id", "create_session"))
        for key, level in (("info_message", logging.INFO), ("warning_message", logging.WARNING),
                           ("error_message", logging.ERROR)):
            if answer.get(key):
                log.log(level, "Server: %s", answer[key])
        self._heartbeat = asyncio.get_running_loop().create_task(self._beat(self._session_id))
        return self._session_id

    async def _beat(self, session_id: str) -> None:
        body = {"session_id": session_id, "type": "session_heartbeat"}
        while True:
            await asyncio.sleep(self._heartbeat_interval_s)
            try:
                await self._http.request(
                    "POST", "session_heartbeat", body, retry=False,
                    timeout_s=self._config.heartbeat_interval_s,
                )
            except APIStatusError as exc:
                if exc.status_code == 410:
                    log.info("Session %s finished on the server; heartbeat stops", session_id)
                    return
                log.warning("Heartbeat for session %s failed: %s", session_id, exc)
            except QuiltError as exc:
                log.warning("Heartbeat for session %s failed: %s", session_id, exc)

    # -- closing -------------------------------------------------------------------------

    def close(self) -> None:
        """Finish the session on the server (reason ``success``) and release resources.

        Idempotent. Futures still pending are cancelled. Raises if the server refuses to
        finish the session; resources are released either way.
        """
        self._close("success", None, raise_errors=True)

    def _close(self, reason: str, detail: str | None, *, raise_errors: bool) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._runner.run(self._shutdown(reason, detail))
        except QuiltError as exc:
            if raise_errors:
                raise
            log.warning("Could not finish session %s: %s", self._session_id, exc)
        finally:
            self._runner.stop()

    async def _shutdown(self, reason: str, detail: str | None) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        try:
            if self._session_id is not None:
                await self._http.request(
                    "POST",
                    f"sessions/{self._session_id}/finish",
                    {"reason": {"type": reason}, "detail": detail},
                )
        finally:
            await self._http.aclose()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
            return
        reason = "interrupted" if issubclass(exc_type, KeyboardInterrupt) else "errored"
        # The body's exception matters more than a failed finish, so only log the latter.
        self._close(reason, f"{exc_type.__name__}: {exc}", raise_errors=False)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Closing joins the loop thread; do it off the caller's loop so that loop keeps running.
        await asyncio.get_running_loop().run_in_executor(None, self.__exit__, exc_type, exc, tb)


async def _make_http(config: Any, transport: httpx.AsyncBaseTransport | None) -> HTTPTransport:
    # Built on the SDK loop, where every later request runs.
    return HTTPTransport(config, transport)


def _create_model_body(
    base_model: str,
    rank: int,
    train_mlp: bool,
    train_attn: bool,
    train_unembed: bool,
    seed: int | None,
    user_metadata: dict[str, Any] | None,
    max_context_length: int | None = None,
) -> dict[str, Any]:
    if not base_model:
        raise ValueError("base_model is required; see client.get_server_capabilities() for names")
    if not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"rank must be a positive int, got {rank!r}")
    if not (train_mlp or train_attn or train_unembed):
        raise ValueError("at least one of train_mlp, train_attn, train_unembed must be True")
    lora: dict[str, Any] = {
        "rank": rank,
        "train_unembed": bool(train_unembed),
        "train_mlp": bool(train_mlp),
        "train_attn": bool(train_attn),
    }
    if seed is not None:
        lora["seed"] = int(seed)
    body: dict[str, Any] = {
        "base_model": base_model,
        "lora_config": lora,
        "optimizer_config": {"type": "adamw"},
        "type": "create_model",
    }
    if user_metadata is not None:
        body["user_metadata"] = dict(user_metadata)
    if max_context_length is not None:
        if not isinstance(max_context_length, int) or max_context_length <= 0:
            raise ValueError(f"max_context_length must be a positive int, got {max_context_length!r}")
        body["max_context_length"] = max_context_length
    return body
