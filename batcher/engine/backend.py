"""The tensors behind the trainer loop: one frozen base, one LoRA adapter and one AdamW per
training model, and a fused forward/backward over many adapters.

The loop (batcher.worker) owns queues and storage; this class owns tensors, behind a few methods
that each return one result or one error per request, so one tenant's bad request fails only that
request.

Fusing uses the grouped multi-LoRA layer of `batcher.engine.multilora` (rows ordered by adapter, one slice
per adapter). It was picked over PEFT's mixed-adapter forward by `bench/trainer_fusion.py`, which
measures both side by side. Checkpoints are PEFT-format adapter directories.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.optim.adamw import adamw

from bases import architectures
from batcher.engine import gang as gang_mod
from batcher.engine import buckets, head, layout, losses, packed_attention, sharded_snapshots
from batcher.engine.graphs import Graphs
from batcher.engine.grouped import Route
from batcher.engine.multilora import SHARED_INPUT, MultiLoraModel, gather
from batcher.engine.transfer import Bundle
from checkpoints.layout import ADAPTER_WEIGHTS, OPTIMIZER_FILE, TrainerMeta
from core.errors import Conflict, InvalidInput, QuiltError, ServerError, UserError
from core.loss_spec import INT_INPUTS, WIDE_INPUTS, LossConfig
from core.work import AdamParams, LoraShape, PassWork

log = logging.getLogger("quilt.trainer.backend")

LORA_ALPHA = 32  # Tinker sends no alpha; a fixed alpha keeps the effective step size comparable across ranks


@dataclass
class Adapter:
    """One training model's trainable state."""

    model_id: str
    name: str  # the adapter's name in the slabs (model ids contain characters PEFT keys cannot)
    lora_config: dict
    params: list[torch.Tensor]  # [A, B] per targeted layer: views of its slab rows while resident
    optimizer: torch.optim.AdamW
    steps: int = 0  # optimizer steps taken: the model's policy version
    last_used: float = field(default_factory=time.monotonic)
    resident: bool = True  # on the compute device (False: parked on the offload device)


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


@dataclass(frozen=True)
class PassRequest:
    """One forward/forward_backward request's slice of a fused pass."""

    request_id: str
    model_id: str
    work: PassWork
    forward_only: bool


@dataclass(frozen=True)
class _Row:
    request_index: int
    datum_index: int
    tokens: tuple[int, ...]
    inputs: Mapping[str, tuple]
    adapter: str
    policy_version: int | None  # the version this datum was sampled with, if it says
    width: int = 1  # targets per position (top-K distillation: K)


@dataclass
class _Batch:
    """One micro-batch, planned on the host."""

    layout: layout.Layout
    rows: list[_Row]  # in layout order: the loss plan's datums
    plan: losses.LossPlan
    bundle: Bundle
    routes: dict[tuple[str, int], Route]  # the token grid's
    head_ranges: list[tuple[int, int]]
    head_routes: list[dict[tuple[str, int], Route]]  # each head chunk's (lm_head only)
    trains: bool
    packed_rows: packed_attention.Rows | None  # the packed layout's rows (None: padded rows)
    requests_size: int  # requests the device work is sized for (the pass's, or its bucket's)
    key: tuple | None = None  # its bucket's graph key (batcher.engine.graphs); None: runs eagerly


class _Gate:
    keep: torch.Tensor | None = None


class LoraBackend:
    def __init__(self, base_path: str | Path, *, device: str = "cpu", max_tokens_per_pass: int = 16384,
                 offload_device: str = "cpu", dtype: torch.dtype = torch.float32, max_resident: int = 0,
                 pack_width: int = 4096, head_chunk_tokens: int = 0, model: torch.nn.Module | None = None,
                 gang: gang_mod.Member | None = None, expert_lora: bool = True, cuda_graphs: bool = True,
                 graph_limit: int = 16, emulate_graphs: bool = False, shared_shrinks: bool = True):
        """`gang`: this process's place in a trainer gang (`batcher.engine.gang`): the base is loaded split
        over the gang's ranks, and every call must be made on every rank in the same order.
        `expert_lora`: MoE bases: whether LoRA may go on the experts (the base's serving setting).
        `cuda_graphs`: on a CUDA device, micro-batches are padded to buckets and replayed from a
        captured graph per bucket (`batcher.engine.graphs`), at most `graph_limit` kept; `emulate_graphs`
        takes that path on any device, replaying by running the captured step again (tests).
        `shared_shrinks`: siblings fed one input (q/k/v, gate/up) share one shrink
        (`batcher.engine.multilora.SHARED_INPUT`); off, each layer shrinks alone (what bench/shared_shrink.py
        measures against)."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModelForCausalLM

        self.gang_size = gang.size if gang is not None else 1
        split = self.gang_size > 1
        self.device = torch.device(gang_mod.rank_device(device) if split else device)
        self.offload_device = torch.device(offload_device)
        self.max_tokens_per_pass = max_tokens_per_pass
        self.pack_width = pack_width  # tokens per packed stream (its attention mask is width x width)
        self.max_resident = max_resident  # adapters on the compute device at once; 0 = no limit
        self.last_pass: PassStats | None = None
        # Which modules can carry LoRA is the architecture's (bases.architectures); a model's own
        # lora_config picks among them. Adapters and their AdamW state are float32 on any base dtype.
        self.config = json.loads((Path(base_path) / "config.json").read_text())
        arch = architectures.of_config(self.config)
        kw = {}
        if arch.moe and dtype == torch.float64:
            kw["experts_implementation"] = "eager"  # grouped_mm has no float64 kernel (float64 is for tests)
        if split:
            problems = gang_mod.check_shape(gang.shape, self.config)
            if problems:
                raise ValueError("this base cannot be split so: " + "; ".join(problems))
        # `model`: a base already built from this config.json (benchmarks make random ones on the device).
        if model is not None:
            base = model
        elif split:
            base = gang_mod.load_base(str(base_path), gang.shape, str(self.device), dtype=dtype, **kw)
        else:
            base = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=dtype, **kw)
        base.requires_grad_(False)
        self.base_path = str(base_path)
        self.base = (base if split else base.to(self.device)).eval()
        targets = arch.targets(tied=architectures.is_tied(self.config))
        self.expert_lora = expert_lora
        # Why a model's LoRA may not go on this MoE base's experts ("": it may). A tensor-parallel
        # gang splits each expert's width, which expert LoRA does not follow (batcher.engine.expert_lora).
        self.experts_refused = ""
        if arch.moe and split and gang.shape.parallel == "tp":
            self.experts_refused = ("this base's trainer gang is tensor parallel, which splits each expert over its "
                                    "ranks; LoRA on the experts needs an expert-parallel gang (quilt models add "
                                    "--trainer-parallel ep)")
        if self.experts_refused or not expert_lora:
            targets = tuple(t for t in targets if t not in architectures.EXPERT_MODULES)
        self.lora = MultiLoraModel(self.base, targets, gang_mod.splits(self.base, targets) if split else None,
                                   SHARED_INPUT if shared_shrinks else ())
        self.lora.max_slots = max_resident
        self.decoder = self.base.get_decoder()
        self.head = self.base.get_output_embeddings()
        text = self.config.get("text_config", self.config)
        self.softcap = text.get("final_logit_softcapping")
        # Grouped GEMM on a GPU wants 16-byte strides: token counts in multiples of 8.
        self.align = 8 if self.device.type == "cuda" else 1
        self.head_chunk_tokens = head_chunk_tokens or head.chunk_tokens_for(text["vocab_size"], align=self.align)
        # The decoder's layer kinds, and the head's (none when it carries no LoRA), whose routes are
        # made per chunk (head_routes).
        self.head_kinds = (self.head.kind,) if hasattr(self.head, "kind") else ()
        self.decoder_kinds = tuple(sorted({layer.kind for layer in self.lora.layers.values()} - set(self.head_kinds)))
        self.adapters: dict[str, Adapter] = {}
        self._next_slot = 0
        self.cuda_graphs = cuda_graphs
        self.graphs = Graphs(self.device, limit=graph_limit, emulate=emulate_graphs)
        self.graph_device = "cuda" if emulate_graphs else self.device.type
        self._refused = ""  # why the last micro-batch ran eagerly (logged when it changes)

    # ------------------------------------------------------------------ adapters

    def has(self, model_id: str) -> bool:
        return model_id in self.adapters

    def create(self, model_id: str, lora: LoraShape) -> None:
        if model_id in self.adapters:
            self.delete(model_id)
        name = f"slot{self._next_slot}"
        self._next_slot += 1
        lora_config = lora.to_json()
        if self.experts_refused and architectures.trains_experts(self.config, lora_config):
            raise InvalidInput(f"{self.experts_refused}; create the model with train_mlp=False",
                               field="lora_config.train_mlp")
        targets = architectures.lora_targets(self.config, lora_config, expert_lora=self.expert_lora)
        params = self.lora.add_adapter(
            name, rank=lora.rank, alpha=LORA_ALPHA, targets=targets,
            seed=lora.seed if lora.seed is not None else int.from_bytes(os.urandom(4), "little"),
        )
        self.adapters[model_id] = Adapter(model_id, name, lora_config, params, self._optimizer(params))

    def delete(self, model_id: str) -> None:
        adapter = self.adapters.pop(model_id, None)
        if adapter is not None:
            self.lora.remove_adapter(adapter.name)

    # ------------------------------------------------------------------ residency

    def _optimizer(self, params: list[torch.Tensor]) -> torch.optim.AdamW:
        # One fused kernel per step on a GPU; the same arithmetic as the for-loop form.
        return torch.optim.AdamW(params, fused=True) if self.device.type == "cuda" else torch.optim.AdamW(params)

    def _park(self, adapter: Adapter) -> None:
        """Rows out of the slabs to the offload device, optimizer moments with them."""
        self.lora.park(adapter.name, self.offload_device)
        self._move_state(adapter, self.offload_device)
        adapter.resident = False

    def _unpark(self, adapter: Adapter) -> None:
        self.lora.restore(adapter.name)
        self._move_state(adapter, self.device)
        adapter.resident = True

    @staticmethod
    def _move_state(adapter: Adapter, device: torch.device) -> None:
        for state in adapter.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and key != "step":
                    state[key] = value.to(device)

    def ensure_resident(self, model_ids) -> None:
        """Bring these models' adapters into the slabs; when that makes more resident than
        `max_resident` (from the memory plan), park the least recently used others first."""
        wanted = set(model_ids)
        now = time.monotonic()
        for model_id in wanted:
            self.adapters[model_id].last_used = now
        if self.max_resident:
            others = sorted((a for a in self.adapters.values() if a.resident and a.model_id not in wanted),
                            key=lambda a: a.last_used)
            for adapter in others[:max(0, len(others) + len(wanted) - self.max_resident)]:
                self._park(adapter)
        for model_id in wanted:
            adapter = self.adapters[model_id]
            if not adapter.resident:
                self._unpark(adapter)

    def offload_idle(self, idle_s: float, *, now: float | None = None) -> int:
        """Park adapters unused for `idle_s` on the offload device; returns how many moved. Their
        slots are freed either way (on a CPU-only worker both devices are the CPU)."""
        now = time.monotonic() if now is None else now
        moved = 0
        for adapter in self.adapters.values():
            if adapter.resident and now - adapter.last_used >= idle_s:
                self._park(adapter)
                moved += 1
        return moved

    def residency(self) -> dict[str, int]:
        resident = sum(a.resident for a in self.adapters.values())
        return {"resident": resident, "offloaded": len(self.adapters) - resident}

    def adapter_state(self, model_id: str) -> dict[str, torch.Tensor]:
        """A copy of the adapter's whole weights under PEFT's saved key names (gathered over a gang)."""
        return self.lora.full_state_dict(self.adapters[model_id].name)

    def optimizer_state(self, model_id: str) -> dict:
        """The adapter's AdamW state dict with whole moments (gathered over a gang: the shares of a
        split layer's A or B are joined as the weights are), so a gang of any size can load it."""
        adapter = self.adapters[model_id]
        state = adapter.optimizer.state_dict()
        shares = self.lora.shares(adapter.name)
        if not any(axis is not None for _, axis in shares):
            return state
        return {**state, "state": {i: {k: gather(shares[i][0], v, shares[i][1]) if k != "step" else v
                                       for k, v in entry.items()}
                                   for i, entry in state["state"].items()}}

    def _load_optimizer_state(self, adapter: Adapter, state: dict) -> None:
        shares = self.lora.shares(adapter.name)
        if any(axis is not None for _, axis in shares):
            state = {**state, "state": {
                int(i): {k: shares[int(i)][0].local(v, shares[int(i)][1]).clone()
                         if k != "step" and shares[int(i)][1] is not None else v for k, v in entry.items()}
                for i, entry in state["state"].items()}}
        adapter.optimizer.load_state_dict(state)

    # ------------------------------------------------------------------ fused pass

    def run_pass(self, requests: list[PassRequest]) -> list[dict | QuiltError]:
        """Run many models' forward/forward_backward requests through one pass over the base.

        Returns one result (Tinker ForwardBackwardOutput JSON) or one error per request, in order.
        The pass is planned on the host (`_plan`), runs on the device without reading anything back
        (`_compute`), and its results come back in one copy at the end.
        """
        outcomes, configs, rows = self._admit(requests)
        models = {requests[i].model_id for i in configs}
        self.ensure_resident(models)
        # Models without pending gradients: a failed pass must leave their gradient rows at zero.
        fresh = [self.adapters[m].name for m in models if not self.lora.pending(self.adapters[m].name)]
        started = time.perf_counter()
        try:
            batches = self._plan(rows, requests, configs)
            values = self._compute(batches, len(requests)).cpu()  # the pass's one read-back
        except Exception as exc:
            if self.gang_size > 1:
                raise  # the ranks may have parted mid-pass: the gang restarts (batcher.engine.gang.GangBroken)
            log.exception("fused pass failed")
            for name in fresh:
                self.lora.discard_grads(name)
            for i in configs:
                outcomes[i] = ServerError(f"trainer pass failed: {type(exc).__name__}: {exc}")
            return outcomes
        self._finish(batches, values, requests, configs, outcomes)
        self.last_pass = PassStats(
            models=len({requests[i].model_id for i in configs}), rows=len(rows),
            tokens=sum(len(r.tokens) for r in rows), padded_tokens=sum(b.layout.tokens for b in batches),
            micro_batches=len(batches), seconds=time.perf_counter() - started,
        )
        return outcomes

    def planned_pass(self, requests: list[PassRequest]) -> Callable[[], torch.Tensor]:
        """A pass's host half done now; the function returned runs only its device half (forward,
        losses, backward), without finishing the requests: what synchronisation checks watch."""
        _, configs, rows = self._admit(requests)
        self.ensure_resident({requests[i].model_id for i in configs})
        batches = self._plan(rows, requests, configs)
        return lambda: self._compute(batches, len(requests))

    def _admit(self, requests: list[PassRequest]) -> tuple[list, dict[int, LossConfig], list[_Row]]:
        """Each request's rows, or its error when its model is not here."""
        outcomes: list[dict | QuiltError | None] = [None] * len(requests)
        configs: dict[int, LossConfig] = {}
        rows: list[_Row] = []
        for i, req in enumerate(requests):
            if req.model_id not in self.adapters:
                outcomes[i] = ServerError(f"model {req.model_id!r} is not loaded on this trainer")
                continue
            adapter = self.adapters[req.model_id]
            # The trainer's policy version is the model's optimizer step count.
            configs[i] = dataclasses.replace(req.work.loss_config, current_policy_version=adapter.steps)
            rows += [_Row(i, j, d.tokens, d.inputs, adapter.name, d.policy_version, d.width)
                     for j, d in enumerate(req.work.data)]
        return outcomes, configs, rows

    def _plan(self, rows: list[_Row], requests: list[PassRequest], configs: dict[int, LossConfig]) -> list[_Batch]:
        """Lay the rows out in micro-batches and build, per micro-batch, everything its device work
        reads, in one bundle: token grid, positions, targets, loss inputs, routes. A micro-batch
        that may replay a captured graph is padded to its bucket (`batcher.engine.buckets`)."""
        lengths = [len(r.tokens) for r in rows]
        pack = layout.can_pack(self.config, max(lengths, default=0))
        capture = self.cuda_graphs and self.graph_device == "cuda"
        n_requests = buckets.requests(len(requests)) if capture else len(requests)
        batches = []
        for lay in layout.micro_batches(lengths, [self.lora.order(r.adapter) for r in rows],
                                        budget=self.max_tokens_per_pass,
                                        pack=pack, pack_width=self.pack_width, align=self.align):
            bucket = self._bucket(lay, rows) if capture else None
            batches.append(self._plan_batch(bucket or lay, rows, lengths, requests, configs, n_requests,
                                            static=bucket is not None))
        return batches

    def _bucket(self, lay: layout.Layout, rows: list[_Row]) -> layout.Layout | None:
        """The micro-batch laid out on its bucket's grid, where it may replay a captured graph
        (`buckets.refusal`); None where it runs eagerly."""
        bucket = buckets.layout(lay, align=self.align, cap=self.max_tokens_per_pass)
        chunks = {e - s for s, e in layout.chunks(bucket.tokens, self.head_chunk_tokens)}
        experts = any(kind in architectures.EXPERT_MODULES for kind in self.decoder_kinds
                      if any(kind in self.lora.adapters[rows[i].adapter].kinds for i in lay.rows))
        why = buckets.refusal(device=self.graph_device, enabled=self.cuda_graphs, gang=self.gang_size,
                              packed=lay.packed, experts=experts,
                              grouped=self.lora.grouped_everywhere([bucket.tokens, *chunks]),
                              varlen=packed_attention.varlen_works() or self.device.type != "cuda")
        if why and why != self._refused:
            log.info("fused passes run eagerly: %s", why)
        self._refused = why
        return None if why else bucket

    def _plan_batch(self, lay: layout.Layout, rows: list[_Row], lengths: list[int], requests: list[PassRequest],
                    configs: dict[int, LossConfig], n_requests: int, static: bool) -> _Batch:
        batch_rows = [rows[i] for i in lay.rows]
        bundle = Bundle()
        K = max(r.width for r in batch_rows)
        ids = torch.zeros(lay.tokens, dtype=torch.long)
        targets = torch.zeros(lay.tokens, K, dtype=torch.long)
        positions = torch.zeros(lay.tokens, dtype=torch.long)
        at = []
        for row, start in zip(batch_rows, lay.starts):
            n = len(row.tokens)
            ids[start:start + n] = torch.tensor(row.tokens)
            targets[start:start + n, :row.width] = torch.tensor(row.inputs["target_tokens"]).view(n, -1)
            positions[start:start + n] = torch.arange(n)
            at.append(torch.arange(start, start + n))
        shape = (lay.streams, lay.width)
        bundle.add("ids", ids.view(shape), torch.long)
        bundle.add("positions", positions.view(shape), torch.long)
        rows_of = None
        if lay.packed:
            cu = packed_attention.boundaries(list(lay.starts), [len(r.tokens) for r in batch_rows], lay.streams,
                                             lay.width)
            max_len = max(b - a for a, b in zip(cu, cu[1:]))
            if static:  # a fixed count of offsets (empty rows at the end), the stream's width the longest
                bundle.add("segments", packed_attention.segments_of(cu, lay.tokens), torch.int32)
                cu = cu + [cu[-1]] * (buckets.boundaries(len(cu)) - len(cu))
                max_len = lay.width
            bundle.add("cu_seqlens", cu, torch.int32)
            rows_of = packed_attention.Rows(
                tuple((start // lay.width, start % lay.width, start % lay.width + len(r.tokens))
                      for r, start in zip(batch_rows, lay.starts)),
                lay.width, max_len=max_len)
        bundle.add("targets", targets, torch.long)
        positions_size = lay.tokens + 1 if static else None  # + 1: the loss's padding position
        at = torch.cat(at)
        if static:
            at = torch.cat([at, torch.zeros(positions_size - at.shape[0], dtype=torch.long)])
        bundle.add("at", at, torch.long)
        specs = []
        for row in batch_rows:
            config = configs[row.request_index]
            sampled_at = row.policy_version if row.policy_version is not None else config.policy_version
            inputs = {k: _input_tensor(k, v, len(row.tokens), row.width) for k, v in row.inputs.items()
                      if k != "target_tokens"}
            specs.append(losses.DatumSpec(requests[row.request_index].work.loss_fn, inputs, len(row.tokens),
                                          row.width, config, sampled_at))
        plan = losses.LossPlan.build(specs, K, pad=(positions_size, buckets.datums(len(specs))) if static else None)
        for name, t in plan.tensors.items():
            bundle.add(f"loss.{name}", t, t.dtype)
        request_of = [r.request_index for r in batch_rows]
        bundle.add("request_of_datum", request_of + [0] * (plan.size - len(request_of)), torch.long)
        trains = [not req.forward_only for req in requests]
        bundle.add("trains", trains + [False] * (n_requests - len(trains)), torch.bool)
        runs = layout.segments(lay, lengths, [r.adapter for r in rows])
        grid = self.lora.routes(runs, self.decoder_kinds)
        head_ranges = layout.chunks(lay.tokens, self.head_chunk_tokens)
        heads = [self.lora.routes(layout.window(runs, s, e), self.head_kinds) for s, e in head_ranges]
        count = buckets.runs(max((len(r) for h in (grid, *heads) for r in h.values()), default=1)) if static else 0
        routes = self._routes(bundle, "grid", grid, count, lay.tokens)
        for (kind, rank), route in routes.items():
            if kind in architectures.EXPERT_MODULES:
                members, of_run = route.membership(zero=self.lora.classes[rank].capacity)
                bundle.add(f"grid.{kind}.{rank}.members", members, torch.long)
                bundle.add(f"grid.{kind}.{rank}.member_of_run", of_run, torch.long)
        head_routes = [self._routes(bundle, f"head{i}", h, count, e - s)
                       for i, (h, (s, e)) in enumerate(zip(heads, head_ranges))]
        trains_here = any(not requests[r.request_index].forward_only for r in batch_rows)
        return _Batch(lay, batch_rows, plan, bundle, routes, head_ranges, head_routes, trains_here, rows_of,
                      n_requests, (trains_here, bundle.signature()) if static else None)

    def _routes(self, bundle: Bundle, prefix: str, host: dict, count: int, tokens: int) -> dict[tuple[str, int], Route]:
        """Each route's device copies into the bundle; `count`: a captured pass's runs per route
        (padded with empty runs in the zero row at the end), 0 for as many as there are."""
        routes = {}
        for (kind, rank), runs in host.items():
            if count:
                runs = runs + ((self.lora.classes[rank].capacity, tokens, tokens),) * (count - len(runs))
            key = f"{prefix}.{kind}.{rank}"
            bundle.add(f"{key}.offsets", [e for _, _, e in runs], torch.int32)
            bundle.add(f"{key}.slots", [slot for slot, _, _ in runs], torch.long)
            routes[(kind, rank)] = Route(runs, static=bool(count))
        return routes

    def _compute(self, batches: list[_Batch], n_requests: int) -> torch.Tensor:
        """Every micro-batch's forward (and backward), all on the device; returns one tensor of what
        the host needs, per micro-batch: per-datum loss, mismatch sums and whether each request kept
        its gradient, then every position's logprobs and elementwise loss. A micro-batch with a
        bucket replays its graph (`batcher.engine.graphs`); the others run eagerly."""
        self.lora.refresh()
        size = batches[0].requests_size if batches else n_requests
        poisoned = torch.zeros(size, dtype=torch.bool, device=self.device)
        out = []
        for batch in batches:
            if batch.key is None:
                values, poisoned = self._bind(batch, batch.bundle.to(self.device), poisoned)()
            else:
                values, poisoned = self.graphs.run(batch.key, batch.bundle, poisoned, self.lora.generation,
                                                   lambda t, p, batch=batch: self._bind(batch, t, p))
            out.append(values)
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)

    def _bind(self, batch: _Batch, t: dict, poisoned: torch.Tensor) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """The micro-batch's device work over the device tensors `t` (its bundle, or a bucket's
        static copy): a step returning its values and the requests poisoned after it."""
        for prefix, routes in (("grid", batch.routes), *((f"head{i}", r) for i, r in enumerate(batch.head_routes))):
            for (kind, rank), route in routes.items():
                key = f"{prefix}.{kind}.{rank}"
                route.offsets, route.slots = t[f"{key}.offsets"], t[f"{key}.slots"]
                route.members, route.member_of_run = t.get(f"{key}.members"), t.get(f"{key}.member_of_run")
        if batch.packed_rows is not None:
            batch.packed_rows.cu_seqlens, batch.packed_rows.segments = t["cu_seqlens"], t.get("segments")
        loss_t = {k[5:]: v for k, v in t.items() if k.startswith("loss.")}

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            try:
                with torch.set_grad_enabled(batch.trains):
                    lp, result, after = self._batch(batch, t, loss_t, poisoned)
            finally:
                self.lora.context.routes = None
            return torch.cat([result.loss.detach().double(), result.kl, result.abs_diff,
                              result.keep_requests.double(), lp.detach().double().flatten(),
                              result.elementwise.double().flatten()]), after

        return step

    def _batch(self, batch: _Batch, t: dict, loss_t: dict, poisoned: torch.Tensor):
        self.lora.context.routes = batch.routes
        if batch.packed_rows is not None:
            # Each row attends to itself only (packed_attention), its positions counted from 0.
            with packed_attention.packed(self.base, batch.packed_rows):
                hidden = self.decoder(input_ids=t["ids"], position_ids=t["positions"],
                                      use_cache=False).last_hidden_state
        else:  # right padding needs no mask: causal attention never lets a real position see a later pad
            hidden = self.decoder(input_ids=t["ids"], use_cache=False).last_hidden_state

        def use_routes(i: int) -> None:
            self.lora.context.routes = batch.head_routes[i]

        lp_grid = head.target_logprobs(self.head, hidden.reshape(-1, hidden.shape[-1]), t["targets"],
                                       batch.head_ranges, use_routes, softcap=self.softcap)
        lp = lp_grid.index_select(0, t["at"])
        gate = _Gate()
        if batch.trains:
            lp = losses.GradGate.apply(lp, gate)
        result = losses.pass_losses(lp, batch.plan, loss_t)
        # A request with a datum whose loss is not finite keeps none of its gradient from here on;
        # decided on the device, so nothing waits for the host.
        bad = torch.zeros(poisoned.shape, dtype=torch.int32, device=poisoned.device).index_add_(
            0, t["request_of_datum"], (~torch.isfinite(result.loss)).int()) > 0
        keep_requests = t["trains"] & ~(bad | poisoned)
        result.keep_requests = keep_requests
        keep_datums = keep_requests.index_select(0, t["request_of_datum"])
        if batch.trains:
            gate.keep = keep_datums.index_select(0, loss_t["datum"])
            torch.where(keep_datums, result.loss, 0.0).sum().backward()
        return lp, result, poisoned | bad

    def _finish(self, batches: list[_Batch], values: torch.Tensor, requests: list[PassRequest],
                configs: dict[int, LossConfig], outcomes: list) -> None:
        """Results, errors and gradients from the values the pass read back."""
        per_datum: dict[int, dict[int, losses.DatumLoss]] = {i: {} for i in configs}
        not_finite: dict[int, list[int]] = {}
        kept: set[int] = set()  # requests whose gradient some micro-batch accumulated
        at = 0
        for batch in batches:
            D, R = batch.plan.size, batch.requests_size
            M, K = batch.plan.tensors["datum"].shape[0], batch.plan.width
            loss, kl, abs_diff = (values[at + j * D:at + (j + 1) * D].tolist() for j in range(3))
            keep = values[at + 3 * D:at + 3 * D + R].tolist()
            at += 3 * D + R
            lp = values[at:at + M * K].view(M, K).float()
            elementwise = values[at + M * K:at + 2 * M * K].view(M, K).float()
            at += 2 * M * K
            present = {row.request_index for row in batch.rows}
            kept |= {i for i in present if keep[i]}
            offset = 0
            for row, datum in zip(batch.rows, batch.plan.metrics(loss, kl, abs_diff)):
                n = len(row.tokens)
                sl = slice(offset, offset + n)
                offset += n
                shape = (n, row.width) if row.width > 1 else (n,)
                outputs = {"logprobs": lp[sl, :row.width].reshape(shape),
                           "elementwise_loss": elementwise[sl, :row.width].reshape(shape)}
                datum.outputs = outputs
                per_datum[row.request_index][row.datum_index] = datum
                if not math.isfinite(datum.metrics["loss:sum"]):
                    not_finite.setdefault(row.request_index, []).append(row.datum_index)
        for i in configs:
            if i in not_finite:
                outcomes[i] = self._not_finite(requests[i], sorted(not_finite[i]), i in kept)
            else:
                outcomes[i] = _forward_backward_output([per_datum[i][j] for j in sorted(per_datum[i])])
        discarded = {requests[i].model_id for i in not_finite if i in kept}
        for model_id in {requests[i].model_id for i in kept} - discarded:
            self.lora.set_grads(self.adapters[model_id].name)

    def _not_finite(self, req: PassRequest, datums: list[int], backpropagated: bool) -> UserError:
        """A request whose loss overflowed: it fails, and none of its gradient is kept."""
        where = ", ".join(f"data[{j}]" for j in datums[:8]) + (" ..." if len(datums) > 8 else "")
        msg = (f"the loss of {where} is not finite (it overflowed float32): make the weights or advantages "
               "smaller")
        if backpropagated:
            # Its other datums ran in an earlier micro-batch: that partial gradient cannot be told
            # apart from the model's earlier ones, so all accumulated gradients go.
            self.lora.discard_grads(self.adapters[req.model_id].name)
            msg += "; the model's gradients accumulated since its last optim_step were discarded, send those " \
                   "forward_backward calls again"
        elif not req.forward_only:
            msg += "; no gradient of this request was accumulated"
        return UserError(msg, field="forward_backward_input.data")

    # ------------------------------------------------------------------ barriers

    def optim_step(self, model_id: str, adam: AdamParams) -> dict:
        """AdamW on one model's accumulated gradients (per-model clipping), then clear them."""
        [outcome] = self.optim_steps([(model_id, adam)])
        if isinstance(outcome, QuiltError):
            raise outcome
        return outcome

    def optim_steps(self, steps: list[tuple[str, AdamParams]]) -> list[dict | QuiltError]:
        """`optim_step` for several models at once (distinct models: a round's steps), one result or
        one error per model, in order. Each keeps its own learning rate, betas, eps, weight decay,
        clipping and AdamW state, exactly as one at a time; together they cost one norm kernel for
        every gradient, one read-back of the norms, one AdamW call (fused on a GPU) per set of
        hyperparameters and one zeroing of the gradients, rather than all of that per model."""
        outcomes: list[dict | QuiltError | None] = [
            None if m in self.adapters else ServerError(f"model {m!r} is not loaded on this trainer") for m, _ in steps]
        known = [i for i, outcome in enumerate(outcomes) if outcome is None]
        self.ensure_resident([steps[i][0] for i in known])
        live = []
        for i in known:
            model_id, adam = steps[i]
            adapter = self.adapters[model_id]
            if not any(p.grad is not None for p in adapter.params):
                outcomes[i] = {"metrics": {"skipped:sum": 1.0}}
                continue
            for group in adapter.optimizer.param_groups:
                group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                             weight_decay=adam.weight_decay)
            live.append(i)
        if not live:
            return outcomes
        norms = self._clip([self.adapters[steps[i][0]] for i in live], [steps[i][1].grad_clip_norm for i in live])
        stepping = []
        for i, norm in zip(live, norms.tolist()):  # the steps' one read-back
            adapter = self.adapters[steps[i][0]]
            if not math.isfinite(norm):
                # Finite losses can still give gradients past float32; a step would make the weights NaN.
                self.lora.clear_grads(adapter.name)
                outcomes[i] = UserError("the accumulated gradients are not finite (they overflowed float32): make "
                                        "the weights or advantages smaller; the gradients were discarded and the "
                                        "weights are unchanged", field="adam_params")
                continue
            stepping.append(adapter)
            outcomes[i] = {"metrics": {"grad_norm:mean": norm, "learning_rate:mean": steps[i][1].learning_rate,
                                       "step:max": float(adapter.steps + 1)}}
        self._adamw(stepping)
        for adapter in stepping:
            self.lora.clear_grads(adapter.name)
            self.lora.changed(adapter.name)
            adapter.steps += 1
        return outcomes

    def _adamw(self, adapters: list[Adapter]) -> None:
        """One AdamW call per set of hyperparameters over these models' parameters, each with its own
        state: what each model's optimizer.step() does, the same arithmetic (on a GPU one fused
        kernel for all; on the CPU tensor by tensor, as torch's CPU AdamW goes, which keeps each small
        tensor in cache across its updates). A model's first step goes through its own optimizer,
        which makes its state."""
        groups: dict[tuple, list[Adapter]] = {}
        for adapter in adapters:
            if any(p.grad is not None and not adapter.optimizer.state.get(p) for p in adapter.params):
                adapter.optimizer.step()
                continue
            [group] = adapter.optimizer.param_groups
            key = (group["lr"], group["betas"], group["eps"], group["weight_decay"], group["amsgrad"],
                   group["maximize"])
            groups.setdefault(key, []).append(adapter)
        for (lr, (beta1, beta2), eps, weight_decay, amsgrad, maximize), members in groups.items():
            params = [p for a in members for p in a.params if p.grad is not None]
            states = [a.optimizer.state[p] for a in members for p in a.params if p.grad is not None]
            with torch.no_grad():
                adamw(
                    params, [p.grad for p in params], [s["exp_avg"] for s in states],
                    [s["exp_avg_sq"] for s in states], [s["max_exp_avg_sq"] for s in states] if amsgrad else [],
                    [s["step"] for s in states], foreach=False, fused=self.device.type == "cuda",
                    amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps,
                    maximize=maximize)

    def _clip(self, adapters: list[Adapter], clips: list[float]) -> torch.Tensor:
        """`clip_grad_norm_` of each adapter's whole gradient (a clip of 0: none), for all of them at
        once; returns their norms. Under a split base the squared norms of the shares are summed over
        the gang in one all-reduce (a whole tensor counts once)."""
        grads, owner, shared, split = [], [], [], None
        for k, adapter in enumerate(adapters):
            for p, (share, axis) in zip(adapter.params, self.lora.shares(adapter.name)):
                if p.grad is not None:
                    grads.append(p.grad)
                    owner.append(k)
                    shared.append(axis is not None)
                    split = split or (share if axis is not None else None)
        squares = torch.stack(torch._foreach_norm(grads)).pow(2)
        bundle = Bundle()  # the host's side of it, in one transfer
        bundle.add("owner", owner, torch.long)
        bundle.add("shared", shared, torch.bool)
        bundle.add("limits", [c if c > 0 else math.inf for c in clips], squares.dtype)
        t = bundle.to(squares.device)
        if split is None:
            sq = squares.new_zeros(len(adapters)).index_add_(0, t["owner"], squares)
        else:
            parts = squares.new_zeros(len(adapters)).index_add_(0, t["owner"], torch.where(t["shared"], squares, 0.0))
            split.all_reduce(parts)
            sq = parts.index_add_(0, t["owner"], torch.where(t["shared"], 0.0, squares))
        norms = sq.sqrt()
        # torch's own rule: scale by max_norm / (norm + 1e-6), never up
        coefs = torch.clamp(t["limits"] / (norms + 1e-6), max=1.0)
        for k, adapter in enumerate(adapters):
            torch._foreach_mul_([p.grad for p in adapter.params if p.grad is not None], coefs[k])
        return norms

    def policy_version(self, model_id: str) -> int:
        """The model's policy version: how many optimizer steps its weights have taken."""
        return self.adapters[model_id].steps

    def save(self, model_id: str, directory: str, *, overwrite: bool, with_optimizer: bool = True) -> int:
        """Write the adapter in PEFT format (what vLLM loads), plus optimizer state for training
        checkpoints; returns bytes written. Atomic: written beside the target, then renamed."""
        return self.export(model_id, directory, overwrite=overwrite, with_optimizer=with_optimizer)()

    def export(self, model_id: str, directory: str, *, overwrite: bool, with_optimizer: bool = True) -> Callable[[], int]:
        """`save`, in two halves: this call takes what will be written (the weights copied on the
        device, the optimizer state by reference) and checks the target; the function it returns
        writes it, from any thread. Until that has returned, nothing may change the adapter's
        optimizer state in place: no optim_step and no load of this model (batcher.exports keeps
        to that)."""
        from safetensors.torch import save_file

        self.ensure_resident([model_id])
        adapter = self.adapters[model_id]
        dest = Path(directory)
        if dest.exists() and not overwrite:
            raise Conflict(f"checkpoint {dest.name!r} already exists; pass overwrite=True to replace it", field="path")
        # Copies: a resident adapter's tensors are views of slab rows, which parking this adapter would
        # hand to another while the writer still reads them.
        state = self.adapter_state(model_id)
        config = self._peft_config(adapter)
        optimizer = self.optimizer_state(model_id) if with_optimizer else None
        meta = TrainerMeta(dict(adapter.lora_config), adapter.steps)

        def write() -> int:
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=dest.parent))
            try:
                save_file({k: v.contiguous().cpu() for k, v in state.items()}, str(tmp / ADAPTER_WEIGHTS))
                config.save_pretrained(str(tmp))
                if optimizer is not None:
                    torch.save(optimizer, tmp / OPTIMIZER_FILE)
                meta.write(tmp)
                if dest.exists():
                    shutil.rmtree(dest)
                tmp.rename(dest)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            return sum(f.stat().st_size for f in dest.iterdir())

        return write

    def snapshot(self, model_id: str, directory: str) -> int:
        """Write the model's durable state (batcher.snapshots) into `directory`; returns bytes written.
        One process writes a training checkpoint (`save`); a gang writes each rank's shares with
        torch.distributed.checkpoint (batcher.engine.sharded_snapshots: a collective, nothing gathered)."""
        if self.gang_size == 1:
            return self.save(model_id, directory, overwrite=True, with_optimizer=True)
        self.ensure_resident([model_id])
        return sharded_snapshots.save(self, model_id, directory)

    def load_snapshot(self, model_id: str, directory: str) -> None:
        """Load a snapshot of either kind into an existing model of the same LoRA shape (a sharded
        one written by a gang of any size, resharded here; a collective in a gang)."""
        self.ensure_resident([model_id])
        if sharded_snapshots.is_sharded(directory):
            sharded_snapshots.load(self, model_id, directory)
        else:
            self.load(model_id, directory, optimizer=True)

    def load(self, model_id: str, directory: str, *, optimizer: bool) -> None:
        """Load a checkpoint into an existing model with the same LoRA shape; clears gradients.
        Without `optimizer`, the optimizer starts fresh (Tinker's load_state semantics)."""
        self.load_saved(model_id, read_saved(directory, optimizer=optimizer))

    def load_saved(self, model_id: str, saved: Saved) -> None:
        """`load`, from a checkpoint already read (a gang's rank 0 reads it and hands it to the
        others, so no rank but 0 needs the files)."""
        self.ensure_resident([model_id])
        adapter = self.adapters[model_id]
        ours = adapter.lora_config
        for key in ("rank", "train_attn", "train_mlp", "train_unembed"):
            if saved.meta.lora_config.get(key, True) != ours.get(key, True):
                raise InvalidInput(f"checkpoint has lora_config.{key}={saved.meta.lora_config.get(key)!r} but this "
                                   f"model has {ours.get(key)!r}", field="path")
        try:
            self.lora.load_state_dict(adapter.name, saved.weights)
        except ValueError as exc:
            raise InvalidInput(f"checkpoint does not fit this model: {exc}", field="path") from None
        self.lora.clear_grads(adapter.name)
        adapter.optimizer = self._optimizer(adapter.params)
        if saved.optimizer is not None:
            self._load_optimizer_state(adapter, saved.optimizer)
        adapter.steps = saved.meta.steps

    def _peft_config(self, adapter: Adapter):
        """The adapter_config.json that PEFT and vLLM read."""
        from peft import LoraConfig

        return LoraConfig(r=int(adapter.lora_config["rank"]), lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                          target_modules=architectures.peft_modules(architectures.lora_targets(self.config,
                                                                                               adapter.lora_config)),
                          bias="none", task_type="CAUSAL_LM",
                          base_model_name_or_path=self.base_path)


@dataclass(frozen=True)
class Saved:
    """A checkpoint directory read into host memory: whole PEFT weights, AdamW state if asked for."""

    meta: TrainerMeta
    weights: dict[str, torch.Tensor]
    optimizer: dict | None


def read_saved(directory: str, *, optimizer: bool) -> Saved:
    from safetensors.torch import load_file

    src = Path(directory)
    meta = TrainerMeta.read(src)
    return Saved(meta, load_file(str(src / ADAPTER_WEIGHTS)),
                 torch.load(src / OPTIMIZER_FILE, weights_only=True) if optimizer else None)


def _input_tensor(key: str, values: tuple, n: int, width: int) -> torch.Tensor:
    """A datum's loss input as the loss reads it: (n,), or (n, K) for top-K targets and weights."""
    t = torch.tensor(values, dtype=torch.long if key in INT_INPUTS else torch.float32)
    return t.view(n, width) if width > 1 and key in WIDE_INPUTS else t


def _forward_backward_output(per_datum: list[losses.DatumLoss]) -> dict:
    outputs = []
    for d in per_datum:
        outputs.append({
            key: {"data": t.detach().float().cpu().flatten().tolist(), "dtype": "float32", "shape": list(t.shape)}
            for key, t in d.outputs.items()
        })
    return {"loss_fn_output_type": "ArrayRecord", "loss_fn_outputs": outputs,
            "metrics": losses.reduce_metrics(per_datum)}
