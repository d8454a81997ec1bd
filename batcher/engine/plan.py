"""The host half of a fused pass: rows in, micro-batches out, no device work.

Each request's datums become rows; rows are laid out in micro-batches (`batcher.engine.layout`:
packed streams, or right-padded rows), and each micro-batch gets everything its device work reads,
as one typed record (`PassTensors`) that travels in one transfer (`batcher.engine.transfer`):
token grid, positions, targets, the loss plan's tensors (`batcher.engine.losses`), and each layer
kind's routes. A micro-batch that may replay a captured graph is padded to its bucket
(`batcher.engine.buckets`) and carries its graph key.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from bases import architectures
from batcher.engine import buckets, custom_losses, layout, losses, packed_attention, vision
from batcher.engine.grouped import Route
from batcher.engine.multilora import MultiLoraModel
from batcher.engine.protocol import PassRequest
from batcher.engine.transfer import Bundle
from core.loss_spec import CUSTOM, INT_INPUTS, WIDE_INPUTS, LossConfig

log = logging.getLogger("quilt.trainer.backend")

RouteKey = tuple[str, int]  # (layer kind, rank)


@dataclass(frozen=True)
class Row:
    """One datum of one request, as the pass lays it out."""

    request_index: int
    datum_index: int
    tokens: tuple[int, ...]
    inputs: Mapping[str, tuple[Any, ...]]
    adapter: str
    policy_version: int | None  # the version this datum was sampled with, if it says
    width: int = 1  # targets per position (top-K distillation: K)
    images: tuple[Any, ...] = ()  # core.work.ImageInput, a vision base's (batcher.engine.vision)


@dataclass
class RouteTensors:
    """One route's device copies (`grouped.Route`): run ends and slots; for the experts, the pass's
    own adapters and each run's index among them."""

    offsets: torch.Tensor  # int32
    slots: torch.Tensor  # int64
    members: torch.Tensor | None = None
    member_of_run: torch.Tensor | None = None

    def bind(self, route: Route) -> None:
        route.offsets, route.slots = self.offsets, self.slots
        route.members, route.member_of_run = self.members, self.member_of_run


@dataclass
class PassTensors:
    """Everything a micro-batch's device work reads (host tensors when planned, views of one device
    buffer after the transfer)."""

    ids: torch.Tensor  # [streams, width] token ids
    positions: torch.Tensor  # [streams, width], each row counted from 0
    targets: torch.Tensor  # [tokens, K]
    at: torch.Tensor  # the loss's positions in the token grid
    request_of_datum: torch.Tensor
    trains: torch.Tensor  # per request: whether it keeps a gradient
    loss: losses.LossTensors
    grid: dict[RouteKey, RouteTensors]  # the decoder's routes
    heads: list[dict[RouteKey, RouteTensors]]  # each head chunk's (lm_head only)
    cu_seqlens: torch.Tensor | None = None  # packed rows' boundaries
    segments: torch.Tensor | None = None  # packed rows' ids per token (a captured pass)
    vision: vision.VisionTensors | None = None  # the micro-batch's images (batcher.engine.vision)


pytree.register_dataclass(RouteTensors)
pytree.register_dataclass(PassTensors)


@dataclass
class PlannedBatch:
    """One micro-batch, planned on the host."""

    layout: layout.Layout
    rows: list[Row]  # in layout order: the loss plan's datums
    plan: losses.LossPlan
    bundle: Bundle[PassTensors]
    routes: dict[RouteKey, Route]  # the token grid's
    head_ranges: list[tuple[int, int]]
    head_routes: list[dict[RouteKey, Route]]  # each head chunk's (lm_head only)
    trains: bool
    packed_rows: packed_attention.Rows | None  # the packed layout's rows (None: padded rows)
    requests_size: int  # requests the device work is sized for (the pass's, or its bucket's)
    key: tuple[Any, ...] | None = None  # its bucket's graph key (batcher.engine.graphs); None: runs eagerly
    custom: list[custom_losses.CustomDatum] = field(default_factory=list)  # its datums of custom losses
    checkpoint: bool = False  # its decoder layers checkpointed (batcher.engine.recompute)


def checkpoints(tokens: int, trains: bool, threshold: int) -> bool:
    """Whether a micro-batch of `tokens` (its grid, padding included) checkpoints its decoder layers:
    one that trains, from `threshold` tokens on (0: never). A forward-only pass keeps no activations."""
    return trains and threshold > 0 and tokens >= threshold


@dataclass
class Planner:
    """How this trainer lays passes out: its slabs, base, budgets and whether passes may replay
    captured graphs."""

    lora: MultiLoraModel
    config: dict[str, Any]  # the base's config.json
    budget: int  # tokens per micro-batch
    pack_width: int
    align: int  # token counts rounded up to this (grouped GEMM's strides on a GPU)
    head_chunk_tokens: int
    decoder_kinds: tuple[str, ...]
    head_kinds: tuple[str, ...]
    cuda_graphs: bool
    graph_device: str  # "cuda" where passes capture (or emulate capturing)
    gang_size: int
    device_type: str  # where passes run ("cuda": packed rows need the varlen kernel to replay)
    checkpoint_tokens: int = 0  # micro-batches of this many tokens checkpoint their layers (`checkpoints`)
    refused: str = ""  # why the last micro-batch ran eagerly (logged when it changes)
    images: vision.ImageProcessor | None = None  # a vision base's image processor

    def plan(self, rows: list[Row], requests: list[PassRequest], configs: dict[int, LossConfig]
             ) -> list[PlannedBatch]:
        """Lay the rows out in micro-batches, each with its record of device inputs."""
        lengths = [len(r.tokens) for r in rows]
        capture = self.cuda_graphs and self.graph_device == "cuda"
        n_requests = buckets.requests(len(requests)) if capture else len(requests)
        batches = []
        for lay in self.layouts(rows):
            # A custom loss runs node by node on each datum's shapes: its micro-batch is not captured.
            custom = any(requests[rows[i].request_index].work.custom is not None for i in lay.rows)
            # Images: their features vary in count and place, so such a micro-batch runs eagerly.
            eager = custom or any(rows[i].images for i in lay.rows)
            bucket = self._bucket(lay, rows) if capture and not eager else None
            batches.append(self._batch(bucket or lay, rows, lengths, requests, configs, n_requests,
                                       static=bucket is not None))
        return batches

    def layouts(self, rows: list[Row]) -> list[layout.Layout]:
        """The micro-batches these rows take (`plan` lays them out so; a data-parallel gang counts
        every rank's from it, `batcher.engine.data_parallel`)."""
        lengths = [len(r.tokens) for r in rows]
        pack = layout.can_pack(self.config, max(lengths, default=0))
        return layout.micro_batches(lengths, [self.lora.order(r.adapter) for r in rows], budget=self.budget,
                                    pack=pack, pack_width=self.pack_width, align=self.align)

    def _bucket(self, lay: layout.Layout, rows: list[Row]) -> layout.Layout | None:
        """The micro-batch laid out on its bucket's grid, where it may replay a captured graph
        (`buckets.refusal`); None where it runs eagerly."""
        bucket = buckets.layout(lay, align=self.align, cap=self.budget)
        chunks = {e - s for s, e in layout.chunks(bucket.tokens, self.head_chunk_tokens)}
        experts = any(kind in architectures.EXPERT_MODULES for kind in self.decoder_kinds
                      if any(kind in self.lora.adapters[rows[i].adapter].kinds for i in lay.rows))
        why = buckets.refusal(device=self.graph_device, enabled=self.cuda_graphs, gang=self.gang_size,
                              packed=lay.packed, experts=experts,
                              grouped=self.lora.grouped_everywhere([bucket.tokens, *chunks]),
                              # asked each time: the kernel is given up on once a call of it fails
                              varlen=self.device_type != "cuda" or packed_attention.varlen_works())
        if why and why != self.refused:
            log.info("fused passes run eagerly: %s", why)
        self.refused = why
        return None if why else bucket

    def _batch(self, lay: layout.Layout, rows: list[Row], lengths: list[int], requests: list[PassRequest],
               configs: dict[int, LossConfig], n_requests: int, static: bool) -> PlannedBatch:
        batch_rows = [rows[i] for i in lay.rows]
        width = max(r.width for r in batch_rows)
        ids, targets, positions, at = _grid(lay, batch_rows, width)
        packed_rows, cu_seqlens, segments = _packed(lay, batch_rows, static)
        positions_size = lay.tokens + 1 if static else None  # + 1: the loss's padding position
        if positions_size is not None:
            at = torch.cat([at, torch.zeros(positions_size - at.shape[0], dtype=torch.long)])
        plan = losses.LossPlan.build(_specs(batch_rows, requests, configs), width,
                                     pad=(positions_size, buckets.datums(len(batch_rows)))
                                     if positions_size is not None else None)
        request_of = [r.request_index for r in batch_rows]
        trains = [not req.forward_only for req in requests]
        runs = layout.segments(lay, lengths, [r.adapter for r in rows])
        host_grid = self.lora.routes(runs, self.decoder_kinds)
        head_ranges = layout.chunks(lay.tokens, self.head_chunk_tokens)
        host_heads = [self.lora.routes(layout.window(runs, s, e), self.head_kinds) for s, e in head_ranges]
        count = buckets.runs(max((len(r) for h in (host_grid, *host_heads) for r in h.values()), default=1)) \
            if static else 0
        routes, grid = self._routes(host_grid, count, lay.tokens, experts=True)
        heads = [self._routes(h, count, e - s) for h, (s, e) in zip(host_heads, head_ranges)]
        record = PassTensors(
            ids=ids.view(lay.streams, lay.width), positions=positions.view(lay.streams, lay.width), targets=targets,
            at=at, request_of_datum=torch.tensor(request_of + [0] * (plan.size - len(request_of)), dtype=torch.long),
            trains=torch.tensor(trains + [False] * (n_requests - len(trains)), dtype=torch.bool),
            loss=plan.tensors, grid=grid, heads=[t for _, t in heads], cu_seqlens=cu_seqlens, segments=segments,
            vision=self._vision(lay, batch_rows))
        bundle = Bundle(record)
        trains_here = any(not requests[r.request_index].forward_only for r in batch_rows)
        checkpoint = checkpoints(lay.tokens, trains_here, self.checkpoint_tokens)
        return PlannedBatch(lay, batch_rows, plan, bundle, routes, head_ranges, [r for r, _ in heads], trains_here,
                            packed_rows, n_requests, (trains_here, checkpoint, bundle.signature()) if static else None,
                            _custom(batch_rows, requests), checkpoint)

    def _vision(self, lay: layout.Layout, rows: list[Row]) -> vision.VisionTensors | None:
        """A micro-batch's images (None: it has none)."""
        if self.images is None or not any(r.images for r in rows):
            return None
        return vision.host_inputs(self.images, [(start, len(r.tokens), r.images) for r, start in zip(rows, lay.starts)],
                                  lay.tokens)

    def _routes(self, host: dict[RouteKey, tuple[tuple[int, int, int], ...]], count: int, tokens: int, *,
                experts: bool = False) -> tuple[dict[RouteKey, Route], dict[RouteKey, RouteTensors]]:
        """Each route and its device copies; `count`: a captured pass's runs per route (padded with
        empty runs in the zero row at the end), 0 for as many as there are. `experts`: the experts'
        routes also carry their membership (`Route.membership`)."""
        routes, tensors = {}, {}
        for (kind, rank), runs in host.items():
            zero = self.lora.classes[rank].capacity
            if count:
                runs = runs + ((zero, tokens, tokens),) * (count - len(runs))
            route = routes[(kind, rank)] = Route(runs, static=bool(count))
            t = RouteTensors(torch.tensor([e for _, _, e in runs], dtype=torch.int32),
                             torch.tensor([slot for slot, _, _ in runs], dtype=torch.long))
            if experts and kind in architectures.EXPERT_MODULES:
                members, of_run = route.membership(zero=zero)
                t.members = torch.tensor(members, dtype=torch.long)
                t.member_of_run = torch.tensor(of_run, dtype=torch.long)
            tensors[(kind, rank)] = t
        return routes, tensors


def _grid(lay: layout.Layout, rows: list[Row], width: int) -> tuple[torch.Tensor, ...]:
    """The token grid (flat): ids, targets [tokens, width], positions, and where each row's positions lie."""
    ids = torch.zeros(lay.tokens, dtype=torch.long)
    targets = torch.zeros(lay.tokens, width, dtype=torch.long)
    positions = torch.zeros(lay.tokens, dtype=torch.long)
    at = []
    for row, start in zip(rows, lay.starts):
        n = len(row.tokens)
        ids[start:start + n] = torch.tensor(row.tokens)
        targets[start:start + n, :row.width] = torch.tensor(row.inputs["target_tokens"]).view(n, -1)
        positions[start:start + n] = torch.arange(n)
        at.append(torch.arange(start, start + n))
    return ids, targets, positions, torch.cat(at)


def _packed(lay: layout.Layout, rows: list[Row], static: bool
            ) -> tuple[packed_attention.Rows | None, torch.Tensor | None, torch.Tensor | None]:
    """A packed layout's rows, their boundaries and (a captured pass) each token's row id."""
    if not lay.packed:
        return None, None, None
    cu = packed_attention.boundaries(list(lay.starts), [len(r.tokens) for r in rows], lay.streams, lay.width)
    max_len = max(b - a for a, b in zip(cu, cu[1:]))
    segments = None
    if static:  # a fixed count of offsets (empty rows at the end), the stream's width the longest
        segments = torch.tensor(packed_attention.segments_of(cu, lay.tokens), dtype=torch.int32)
        cu = cu + [cu[-1]] * (buckets.boundaries(len(cu)) - len(cu))
        max_len = lay.width
    packed_rows = packed_attention.Rows(
        tuple((start // lay.width, start % lay.width, start % lay.width + len(r.tokens))
              for r, start in zip(rows, lay.starts)), lay.width, max_len=max_len)
    return packed_rows, torch.tensor(cu, dtype=torch.int32), segments


def _custom(rows: list[Row], requests: list[PassRequest]) -> list[custom_losses.CustomDatum]:
    """The rows of custom losses, with where their positions start among the loss plan's."""
    out, start = [], 0
    for k, row in enumerate(rows):
        graph = requests[row.request_index].work.custom
        if graph is not None:
            n = len(row.tokens)
            out.append(custom_losses.CustomDatum(k, start, n, row.width, graph,
                                                 custom_losses.input_tensors(graph, row.inputs, n)))
        start += len(row.tokens)
    return out


def _specs(rows: list[Row], requests: list[PassRequest], configs: dict[int, LossConfig]) -> list[losses.DatumSpec]:
    """Each row as its loss sees it (a custom loss's datum: as no built-in's, its own inputs aside)."""
    specs = []
    for row in rows:
        config = configs[row.request_index]
        sampled_at = row.policy_version if row.policy_version is not None else config.policy_version
        if requests[row.request_index].work.custom is not None:
            specs.append(losses.DatumSpec(CUSTOM, {}, len(row.tokens), row.width, config, sampled_at))
            continue
        inputs = {k: _input_tensor(k, v, len(row.tokens), row.width) for k, v in row.inputs.items()
                  if k != "target_tokens"}
        specs.append(losses.DatumSpec(requests[row.request_index].work.loss_fn, inputs, len(row.tokens), row.width,
                                      config, sampled_at))
    return specs


def _input_tensor(key: str, values: tuple[Any, ...], n: int, width: int) -> torch.Tensor:
    """A datum's loss input as the loss reads it: (n,), or (n, K) for top-K targets and weights."""
    t = torch.tensor(values, dtype=torch.long if key in INT_INPUTS else torch.float32)
    return t.view(n, width) if width > 1 and key in WIDE_INPUTS else t
