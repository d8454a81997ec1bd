"""What the trainer's loop calls of its engine: `TrainerBackend`, and the records that cross.

The loop (`batcher.worker`, `batcher.barriers`, `batcher.snapshots`) is typed against this
protocol only; `batcher.engine.backend.LoraBackend` implements it, in a gang as on one process
(rank 0's backend mirrors its collective calls to the other ranks, `batcher.engine.collective`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from core.errors import QuiltError
from core.work import ADAMW, LoraShape, OptimParams, PassWork

Outcome = dict[str, Any] | QuiltError  # a request's result (its Tinker JSON) or its typed error


@dataclass(frozen=True)
class PassRequest:
    """One forward/forward_backward request's slice of a fused pass."""

    request_id: str
    model_id: str
    work: PassWork
    forward_only: bool


@dataclass(frozen=True)
class PassStats:
    """What one fused pass did, for observability."""

    models: int
    rows: int
    tokens: int  # real model-input tokens
    padded_tokens: int  # tokens computed including right padding
    micro_batches: int
    seconds: float

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.tokens / self.padded_tokens if self.padded_tokens else 0.0


class TrainerBackend(Protocol):
    """The tensors behind the loop: each call returns one result or one error per request, so one
    tenant's bad request fails only that request."""

    @property
    def last_pass(self) -> PassStats | None: ...

    def has(self, model_id: str) -> bool: ...

    def create(self, model_id: str, lora: LoraShape, optimizer: str = ADAMW) -> None: ...

    def delete(self, model_id: str) -> None: ...

    def run_pass(self, requests: list[PassRequest]) -> list[Outcome]: ...

    def optim_step(self, model_id: str, params: OptimParams) -> dict[str, Any]: ...

    def optim_steps(self, steps: list[tuple[str, OptimParams]]) -> list[Outcome]: ...

    def policy_version(self, model_id: str) -> int: ...

    def offload_idle(self, idle_s: float, *, now: float | None = None) -> int: ...

    def residency(self) -> dict[str, int]: ...

    def export(self, model_id: str, directory: str, *, overwrite: bool,
               with_optimizer: bool = True) -> Callable[[], int]: ...

    def load(self, model_id: str, directory: str, *, optimizer: bool) -> None: ...

    def snapshot(self, model_id: str, directory: str) -> int: ...

    def load_snapshot(self, model_id: str, directory: str) -> None: ...
