"""Host tensors that travel to the device together: one buffer, one non-blocking copy.

A fused pass needs dozens of small tensors on the device (token ids, positions, loss inputs, each
layer's routing); copied one by one, each would be a blocking host-to-device copy. Gathered here into
one byte buffer (pinned on a GPU host), they cost one transfer, and the pass reads them as views.
"""

from __future__ import annotations

import torch

from batcher.engine.layout import round_up

_ALIGN = 16  # bytes: every view starts where any dtype (and grouped GEMM) may start


class Bundle:
    def __init__(self) -> None:
        self._parts: dict[str, torch.Tensor] = {}

    def add(self, name: str, values, dtype: torch.dtype) -> str:
        """Queue `values` (a list, a nested list or a host tensor) under `name`; returns the name."""
        t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
        self._parts[name] = t.to(dtype).contiguous()
        return name

    def signature(self) -> tuple:
        """Every queued tensor's name, dtype and shape: bundles of one signature lie alike in memory,
        so one can be copied where another was (a captured pass's static inputs, `batcher.engine.graphs`)."""
        return tuple((name, t.dtype, tuple(t.shape)) for name, t in self._parts.items())

    def _offsets(self) -> tuple[dict[str, int], int]:
        offsets, total = {}, 0
        for name, t in self._parts.items():
            offsets[name] = total
            total += round_up(t.numel() * t.element_size(), _ALIGN)
        return offsets, max(total, _ALIGN)

    def _host(self, pin: bool) -> torch.Tensor:
        offsets, total = self._offsets()
        buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
        for name, t in self._parts.items():
            n = t.numel() * t.element_size()
            if n:
                buffer[offsets[name]:offsets[name] + n].copy_(t.view(-1).view(torch.uint8))
        return buffer

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every queued tensor as a view of `buffer` (one this bundle, or one of its signature, filled)."""
        offsets, _ = self._offsets()
        out = {}
        for name, t in self._parts.items():
            n = t.numel() * t.element_size()
            out[name] = buffer[offsets[name]:offsets[name] + n].view(t.dtype).view(t.shape)
        return out

    def buffer(self, device: torch.device) -> torch.Tensor:
        """One buffer on `device` holding every queued tensor, copied in one transfer."""
        pin = device.type == "cuda"
        return self._host(pin).to(device, non_blocking=pin)

    def to(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Every queued tensor on `device`, as views of one buffer copied in one transfer."""
        return self.views(self.buffer(device))

    def copy_into(self, buffer: torch.Tensor) -> None:
        """Fill a device buffer of this bundle's signature (made by `buffer` for another bundle) in one
        non-blocking transfer."""
        pin = buffer.device.type == "cuda"
        buffer.copy_(self._host(pin), non_blocking=pin)
