"""Host tensors that travel to the device together: one buffer, one non-blocking copy.

A fused pass needs dozens of small tensors on the device (token ids, positions, loss inputs, each
layer's routing); copied one by one, each would be a blocking host-to-device copy. A bundle takes a
typed record of host tensors (dataclasses registered as pytrees, and the dicts, lists and tuples
they hold: `batcher.engine.plan.PassTensors`), lays its tensors out in one byte buffer (pinned on a
GPU host), copies that in one transfer, and gives the record back with every tensor a view of the
device buffer.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import torch
from torch.utils import _pytree as pytree

from batcher.engine.layout import round_up

_ALIGN = 16  # bytes: every view starts where any dtype (and grouped GEMM) may start

T = TypeVar("T")


class Bundle(Generic[T]):
    def __init__(self, record: T) -> None:
        leaves, self._spec = pytree.tree_flatten(record)
        if not all(isinstance(t, torch.Tensor) for t in leaves):
            raise TypeError("a bundle holds host tensors only")
        self._parts: list[torch.Tensor] = [t.contiguous() for t in leaves]
        self._offsets, self._total = self._layout()

    def signature(self) -> tuple[Any, ...]:
        """The record's structure and every tensor's dtype and shape: bundles of one signature lie
        alike in memory, so one can be copied where another was (a captured pass's static inputs,
        `batcher.engine.graphs`)."""
        return self._spec, tuple((t.dtype, tuple(t.shape)) for t in self._parts)

    def _layout(self) -> tuple[list[int], int]:
        offsets, total = [], 0
        for t in self._parts:
            offsets.append(total)
            total += round_up(t.numel() * t.element_size(), _ALIGN)
        return offsets, max(total, _ALIGN)

    def _host(self, pin: bool) -> torch.Tensor:
        buffer = torch.empty(self._total, dtype=torch.uint8, pin_memory=pin)
        for at, t in zip(self._offsets, self._parts):
            n = t.numel() * t.element_size()
            if n:
                buffer[at:at + n].copy_(t.view(-1).view(torch.uint8))
        return buffer

    def views(self, buffer: torch.Tensor) -> T:
        """The record, every tensor a view of `buffer` (this bundle's, or one of its signature, filled)."""
        views = []
        for at, t in zip(self._offsets, self._parts):
            n = t.numel() * t.element_size()
            views.append(buffer[at:at + n].view(t.dtype).view(t.shape))
        record: T = pytree.tree_unflatten(views, self._spec)
        return record

    def buffer(self, device: torch.device) -> torch.Tensor:
        """One buffer on `device` holding every tensor of the record, copied in one transfer."""
        pin = device.type == "cuda"
        return self._host(pin).to(device, non_blocking=pin)

    def to(self, device: torch.device) -> T:
        """The record on `device`, its tensors views of one buffer copied in one transfer."""
        return self.views(self.buffer(device))

    def copy_into(self, buffer: torch.Tensor) -> None:
        """Fill a device buffer of this bundle's signature (made by `buffer` for another bundle) in one
        non-blocking transfer."""
        pin = buffer.device.type == "cuda"
        buffer.copy_(self._host(pin), non_blocking=pin)
