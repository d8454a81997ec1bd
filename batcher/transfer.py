"""Host tensors that travel to the device together: one buffer, one non-blocking copy.

A fused pass needs dozens of small tensors on the device (token ids, positions, loss inputs, each
layer's routing); copied one by one, each would be a blocking host-to-device copy. Gathered here into
one byte buffer (pinned on a GPU host), they cost one transfer, and the pass reads them as views.
"""

from __future__ import annotations

import torch

from batcher.layout import round_up

_ALIGN = 16  # bytes: every view starts where any dtype (and grouped GEMM) may start


class Bundle:
    def __init__(self) -> None:
        self._parts: dict[str, torch.Tensor] = {}

    def add(self, name: str, values, dtype: torch.dtype) -> str:
        """Queue `values` (a list, a nested list or a host tensor) under `name`; returns the name."""
        t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
        self._parts[name] = t.to(dtype).contiguous()
        return name

    def to(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Every queued tensor on `device`, as views of one buffer copied in one transfer."""
        offsets, total = {}, 0
        for name, t in self._parts.items():
            offsets[name] = total
            total += round_up(t.numel() * t.element_size(), _ALIGN)
        pin = device.type == "cuda"
        buffer = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=pin)
        for name, t in self._parts.items():
            n = t.numel() * t.element_size()
            if n:
                buffer[offsets[name]:offsets[name] + n].copy_(t.view(-1).view(torch.uint8))
        on_device = buffer.to(device, non_blocking=pin)
        out = {}
        for name, t in self._parts.items():
            n = t.numel() * t.element_size()
            out[name] = on_device[offsets[name]:offsets[name] + n].view(t.dtype).view(t.shape)
        return out
