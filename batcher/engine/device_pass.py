"""The device half of a fused pass: every micro-batch's forward, losses and backward, with nothing
read back until the pass ends.

A micro-batch's inputs arrive as one record (`batcher.engine.plan.PassTensors`, one transfer); its
routes are bound to the device copies, the decoder and the chunked head run with each token's
adapter (`batcher.engine.multilora`), each layer checkpointed in a long micro-batch
(`batcher.engine.recompute`), the losses are computed at once (`batcher.engine.losses`), and
a request whose loss is not finite keeps none of its gradient, decided on the device. On a GPU a
bucketed micro-batch replays its captured graph (`batcher.engine.graphs`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from batcher.engine import custom_losses, head, losses, packed_attention, recompute, vision
from batcher.engine.graphs import Graphs
from batcher.engine.multilora import MultiLoraModel
from batcher.engine.plan import PassTensors, PlannedBatch


class _Gate:
    keep: torch.Tensor | None = None


class DevicePass:
    def __init__(self, base: Any, lora: MultiLoraModel, graphs: Graphs, device: torch.device, *,
                 softcap: float | None):
        """`base`: a transformers causal LM, its targets wrapped by `lora` (its decoder and head are
        called apart: the head in chunks)."""
        self.base = base
        self.decoder: nn.Module = base.get_decoder()
        self.head: nn.Module = base.get_output_embeddings()
        self.lora = lora
        self.graphs = graphs
        self.device = device
        self.softcap = softcap

    def compute(self, batches: list[PlannedBatch], n_requests: int) -> torch.Tensor:
        """Every micro-batch's forward (and backward), all on the device; returns one tensor of what
        the host needs, per micro-batch (`batcher.engine.results`). A micro-batch with a bucket
        replays its graph (`batcher.engine.graphs`); the others run eagerly."""
        self.lora.refresh()
        size = batches[0].requests_size if batches else n_requests
        poisoned = torch.zeros(size, dtype=torch.bool, device=self.device)
        out = []
        for batch in batches:
            if batch.key is None:
                values, poisoned = self._bind(batch, batch.bundle.to(self.device), poisoned)()
            else:
                values, poisoned = self.graphs.run(batch.key, batch.bundle, poisoned, self.lora.generation,
                                                   functools.partial(self._bind, batch))
            out.append(values)
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)

    def _bind(self, batch: PlannedBatch, t: PassTensors, poisoned: torch.Tensor
              ) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """The micro-batch's device work over the device tensors `t` (its bundle, or a bucket's
        static copy): a step returning its values and the requests poisoned after it."""
        for key, route in batch.routes.items():
            t.grid[key].bind(route)
        for routes, tensors in zip(batch.head_routes, t.heads):
            for key, route in routes.items():
                tensors[key].bind(route)
        if batch.packed_rows is not None:
            batch.packed_rows.cu_seqlens, batch.packed_rows.segments = t.cu_seqlens, t.segments

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            try:
                with torch.set_grad_enabled(batch.trains):
                    lp, result, keep_requests, after, custom_metrics = self._batch(batch, t, poisoned)
            finally:
                self.lora.context.routes = None
            return torch.cat([result.loss.detach().double(), result.kl, result.abs_diff,
                              keep_requests.double(), lp.detach().double().flatten(),
                              result.elementwise.double().flatten(), custom_metrics]), after

        return step

    def _decode(self, batch: PlannedBatch, t: PassTensors) -> torch.Tensor:
        """The decoder's last hidden states, each layer checkpointed where the plan says
        (`batcher.engine.recompute`)."""
        layers: list[nn.Module] = list(getattr(self.decoder, "layers", ())) if batch.checkpoint else []
        # Images: their features in place of their tokens' embeddings, made before the packed rows'
        # attention is switched on (the vision tower's own attention must stay its own).
        images = vision.decoder_inputs(self.base, t.ids, t.positions, t.vision) if t.vision is not None else None
        with self._layer_state(batch), recompute.checkpointed(layers, functools.partial(self._layer_state, batch)):
            if images is not None:
                out = self.decoder(**images, use_cache=False)
            elif batch.packed_rows is not None:
                # Each row attends to itself only (packed_attention), its positions counted from 0.
                out = self.decoder(input_ids=t.ids, position_ids=t.positions, use_cache=False)
            else:  # right padding needs no mask: causal attention never lets a real position see a later pad
                out = self.decoder(input_ids=t.ids, use_cache=False)
        hidden: torch.Tensor = out.last_hidden_state
        return hidden

    @contextlib.contextmanager
    def _layer_state(self, batch: PlannedBatch) -> Iterator[None]:
        """The micro-batch's decoder state: its routes, and a packed pass's rows."""
        self.lora.context.routes = batch.routes
        if batch.packed_rows is None:
            yield
            return
        with packed_attention.packed(self.base, batch.packed_rows):
            yield

    def _batch(self, batch: PlannedBatch, t: PassTensors, poisoned: torch.Tensor
               ) -> tuple[torch.Tensor, losses.PassLosses, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One micro-batch: its logprobs, losses, the requests that keep their gradient, the
        requests poisoned after it, and its custom losses' metrics."""
        hidden = self._decode(batch, t)

        def use_routes(i: int) -> None:
            self.lora.context.routes = batch.head_routes[i]

        lp_grid = head.target_logprobs(self.head, hidden.reshape(-1, hidden.shape[-1]), t.targets,
                                       batch.head_ranges, use_routes, softcap=self.softcap)
        lp = lp_grid.index_select(0, t.at)
        gate = _Gate()
        if batch.trains:
            lp = losses.GradGate.apply(lp, gate)
        result = losses.pass_losses(lp, batch.plan, t.loss)
        # Custom losses' datums: their losses join the built-ins' (zero at their places), so the
        # gate, the non-finite check and the one backward below treat them alike.
        custom_metrics = lp.new_zeros(0, dtype=torch.float64)
        if batch.custom:
            custom_loss, custom_metrics = custom_losses.run_batch(batch.custom, lp, batch.plan.size)
            result.loss = result.loss + custom_loss.to(result.loss.dtype)
        # A request with a datum whose loss is not finite keeps none of its gradient from here on;
        # decided on the device, so nothing waits for the host.
        bad = torch.zeros(poisoned.shape, dtype=torch.int32, device=poisoned.device).index_add_(
            0, t.request_of_datum, (~torch.isfinite(result.loss)).int()) > 0
        keep_requests = t.trains & ~(bad | poisoned)
        keep_datums = keep_requests.index_select(0, t.request_of_datum)
        if batch.trains:
            gate.keep = keep_datums.index_select(0, t.loss.datum)
            torch.where(keep_datums, result.loss, 0.0).sum().backward()
        return lp, result, keep_requests, poisoned | bad, custom_metrics
