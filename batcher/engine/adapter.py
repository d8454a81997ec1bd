"""One training model's trainable state, as the engine keeps it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from core.work import ADAMW

LORA_ALPHA = 32  # Tinker sends no alpha; a fixed alpha keeps the effective step size comparable across ranks


@dataclass
class Adapter:
    """One training model's adapter, optimizer state and place."""

    model_id: str
    name: str  # the adapter's name in the slabs (model ids contain characters PEFT keys cannot)
    lora_config: dict[str, Any]
    params: list[torch.Tensor]  # [A, B] per targeted layer: views of its slab rows while resident
    optimizer: torch.optim.Optimizer
    steps: int = 0  # optimizer steps taken: the model's policy version
    last_used: float = field(default_factory=time.monotonic)
    resident: bool = True  # on the compute device (False: parked on the offload device)
    family: str = ADAMW  # the optimizer's family (core.work.OPTIMIZERS), fixed for the model's life
