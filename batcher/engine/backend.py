"""The tensors behind the trainer loop: one frozen base, one LoRA adapter and one optimizer per
training model, and a fused forward/backward over many adapters.

The loop (batcher.worker) owns queues and storage; this class owns tensors, behind the methods of
`batcher.engine.protocol.TrainerBackend`, each returning one result or one error per request, so one
tenant's bad request fails only that request. Its parts: the host plan of a pass
(`batcher.engine.plan`), the optimizers (`batcher.engine.optimizers`), adapter files
(`batcher.engine.adapter_io`) and the slabs (`batcher.engine.multilora`). Calls that every rank of a
gang must make are marked `@collective()` (`batcher.engine.collective`).

Fusing uses the grouped multi-LoRA layer of `batcher.engine.multilora` (rows ordered by adapter, one
slice per adapter). It was picked over PEFT's mixed-adapter forward by `bench/trainer_fusion.py`,
which measures both side by side. Checkpoints are PEFT-format adapter directories.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

import torch

from bases import architectures, memory_plan
from bases.vision import pretrained_class
from batcher.engine import (
    adapter_io,
    custom_losses,
    data_parallel,
    gang,
    head,
    linear_attention,
    optimizers,
    sharded_snapshots,
    vision,
)
from batcher.engine.adapter import LORA_ALPHA, Adapter
from batcher.engine.collective import Mirror, collective
from batcher.engine.device_pass import DevicePass
from batcher.engine.expert_lora import route_in_float64
from batcher.engine.graphs import Graphs
from batcher.engine.multilora import SHARED_INPUT, MultiLoraModel
from batcher.engine.plan import PlannedBatch, Planner, Row
from batcher.engine.protocol import Outcome, PassRequest, PassStats
from batcher.engine.results import PassResult, read_back
from checkpoints.layout import TrainerMeta
from core.errors import Conflict, InvalidInput, QuiltError, ServerError, UserError
from core.loss_spec import LossConfig
from core.work import ADAMW, DIMUON, OPTIMIZERS, LoraShape, OptimParams

log = logging.getLogger("quilt.trainer.backend")

# The public methods that are not collective (`batcher.engine.collective`): each reads rank 0's own
# state, or reads files on rank 0 and then makes a marked call. tests/test_collective_marks.py holds
# every other public method to its mark.
LOCAL_CALLS = frozenset({
    "has",  # reads the adapters
    "policy_version",  # reads an adapter's step count
    "residency",  # counts the adapters
    "planned_pass",  # a synchronisation check's host half (tests and benches; never in a gang)
    "load",  # reads the checkpoint here, then load_saved on every rank
    "load_snapshot",  # a training checkpoint as `load`; a sharded one by load_sharded on every rank
})


class LoraBackend:
    def __init__(self, base_path: str | Path, *, device: str = "cpu", max_tokens_per_pass: int = 16384,
                 offload_device: str = "cpu", dtype: torch.dtype = torch.float32, max_resident: int = 0,
                 pack_width: int = 4096, head_chunk_tokens: int = 0, model: torch.nn.Module | None = None,
                 member: gang.Member | None = None, expert_lora: bool = True, cuda_graphs: bool = True,
                 graph_limit: int = 16, emulate_graphs: bool = False, shared_shrinks: bool = True,
                 checkpoint_tokens: int = 0):
        """`member`: this process's place in a trainer gang (`batcher.engine.gang`): the base is loaded
        split over the gang's ranks, and every collective call must be made on every rank in the
        same order (rank 0's `mirror` hands them on).
        `expert_lora`: MoE bases: whether LoRA may go on the experts (the base's serving setting).
        `cuda_graphs`: on a CUDA device, micro-batches are padded to buckets and replayed from a
        captured graph per bucket (`batcher.engine.graphs`), at most `graph_limit` kept; `emulate_graphs`
        takes that path on any device, replaying by running the captured step again (tests).
        `shared_shrinks`: siblings fed one input (q/k/v, gate/up) share one shrink
        (`batcher.engine.multilora.SHARED_INPUT`); off, each layer shrinks alone (what
        bench/shared_shrink.py measures against).
        `checkpoint_tokens`: a training micro-batch of at least this many tokens checkpoints each
        decoder layer (`batcher.engine.recompute`); 0: none does."""
        self.mirror: Mirror | None = None  # rank 0 of a gang: its Leader (batcher.engine.gang)
        self.gang_size = member.size if member is not None else 1
        self.device = torch.device(gang.rank_device(device) if self.gang_size > 1 else device)
        self.offload_device = torch.device(offload_device)
        self.max_resident = max_resident  # adapters on the compute device at once; 0 = no limit
        self.last_pass: PassStats | None = None
        # Which modules can carry LoRA is the architecture's (bases.architectures); a model's own
        # lora_config picks among them. Adapters and their optimizer state are float32 on any base dtype.
        self.config = json.loads((Path(base_path) / "config.json").read_text())
        self.arch = architectures.of_config(self.config)
        self.base_path = str(base_path)
        self.base = self._load_base(model, member, dtype)
        # An FSDP gang computes each rank's share of a pass (batcher.engine.data_parallel).
        self.data_parallel: data_parallel.DataParallel | None = None
        if member is not None and self.gang_size > 1 and member.shape.parallel == "fsdp":
            self.data_parallel = data_parallel.DataParallel(member.rank, member.size, member.control)
            data_parallel.backward_through_every_layer(self.base)
            max_tokens_per_pass = memory_plan.rank_tokens(max_tokens_per_pass, member.size)
        self.expert_lora = expert_lora
        # Why a model's LoRA may not go on this MoE base's experts ("": it may). A tensor-parallel
        # gang splits each expert's width, which expert LoRA does not follow (batcher.engine.expert_lora).
        self.experts_refused = ""
        if self.arch.moe and member is not None and self.gang_size > 1 \
                and member.shape.parallel == "tp":
            self.experts_refused = ("this base's trainer gang is tensor parallel, which splits each expert over its "
                                    "ranks; LoRA on the experts needs an expert-parallel gang (quilt models add "
                                    "--trainer-parallel ep)")
        if linear_attention.uses_row_state(self.config):
            # a packed row's recurrence starts from zero (its rows are host spans, which a replayed graph cannot follow)
            linear_attention.register()
            cuda_graphs = emulate_graphs = False
        targets = self._targets()
        self.lora = MultiLoraModel(self.base, targets, gang.splits(self.base, targets) if self.gang_size > 1 else None,
                                   SHARED_INPUT if shared_shrinks else ())
        self.lora.max_slots = max_resident
        text = self.config.get("text_config", self.config)
        self.adapters: dict[str, Adapter] = {}
        self._next_slot = 0
        self.graphs = Graphs(self.device, limit=graph_limit, emulate=emulate_graphs)
        self.device_pass = DevicePass(self.base, self.lora, self.graphs, self.device,
                                      softcap=text.get("final_logit_softcapping"))
        head_module = self.base.get_output_embeddings()
        # Grouped GEMM on a GPU wants 16-byte strides: token counts in multiples of 8.
        align = 8 if self.device.type == "cuda" else 1
        # The decoder's layer kinds, and the head's (none when it carries no LoRA), whose routes are
        # made per chunk.
        head_kinds = (head_module.kind,) if hasattr(head_module, "kind") else ()
        self.planner = Planner(
            self.lora, self.config, budget=max_tokens_per_pass, pack_width=pack_width, align=align,
            head_chunk_tokens=head_chunk_tokens or head.chunk_tokens_for(text["vocab_size"], align=align),
            decoder_kinds=tuple(sorted({layer.kind for layer in self.lora.layers.values()} - set(head_kinds))),
            head_kinds=head_kinds, cuda_graphs=cuda_graphs, graph_device="cuda" if emulate_graphs else self.device.type,
            gang_size=self.gang_size, device_type=self.device.type,
            # An FSDP gang's ranks plan micro-batches of different sizes; one that checkpointed would
            # gather its layers' weights again in the backward while another did not, and the ranks'
            # collectives would part. Its passes keep their activations instead (rank_tokens is 1/N).
            checkpoint_tokens=0 if self.data_parallel is not None else checkpoint_tokens,
            images=vision.ImageProcessor(self.base_path) if self.arch.vision else None)

    def _load_base(self, model: torch.nn.Module | None, member: gang.Member | None, dtype: torch.dtype) -> Any:
        """The frozen base: `model` (a base already built from this config.json: benchmarks make
        random ones on the device), this rank's part of it in a gang, or the whole checkpoint: a
        transformers causal LM, whose decoder and head the pass calls apart."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        kw = _load_kwargs(self.arch, self.config, dtype)
        shape = member.shape if member is not None and member.size > 1 else None
        if shape is not None:
            problems = gang.check_shape(shape, self.config)
            if problems:
                raise ValueError("this base cannot be split so: " + "; ".join(problems))
        base: Any
        if model is not None:
            base = model
        elif shape is not None:
            base = gang.load_base(self.base_path, shape, str(self.device), dtype=dtype, **kw)
        else:  # a vision base with its vision tower (frozen with the rest; batcher.engine.vision)
            base = pretrained_class(self.arch.vision).from_pretrained(self.base_path, dtype=dtype, **kw)
        if "quantization_config" in kw:
            base = base.to(dtype)  # transformers dequantizes MXFP4 to bfloat16 whatever dtype it was asked for
        base.requires_grad_(False)
        if dtype == torch.float64:
            route_in_float64(base)  # (DeepSeek-V3: batcher.engine.expert_lora says why)
        return (base if shape is not None else base.to(self.device)).eval()

    def _targets(self) -> tuple[str, ...]:
        targets = self.arch.targets(tied=architectures.is_tied(self.config))
        if self.experts_refused or not self.expert_lora:
            targets = tuple(t for t in targets if t not in architectures.EXPERT_MODULES)
        return targets

    # ------------------------------------------------------------------ adapters

    def has(self, model_id: str) -> bool:
        return model_id in self.adapters

    @collective()
    def create(self, model_id: str, lora: LoraShape, optimizer: str = ADAMW) -> None:
        """A new adapter with a fresh optimizer of family `optimizer` (core.work.OPTIMIZERS), which it
        keeps for its life."""
        if optimizer not in OPTIMIZERS:
            raise InvalidInput(f"optimizer {optimizer!r} is not one of {sorted(OPTIMIZERS)}", field="optimizer_config")
        if optimizer == DIMUON and self.gang_size > 1:
            # Its matrix-sign iteration needs each LoRA matrix whole, which a gang splits over its ranks.
            raise InvalidInput("Dimuon is not available on a base whose trainer is a gang (its LoRA matrices are "
                               "split over the ranks); use AdamW on this base", field="optimizer_config")
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
        self.adapters[model_id] = Adapter(model_id, name, lora_config, params,
                                          optimizers.new_optimizer(optimizer, params, device=self.device, rank=lora.rank),
                                          family=optimizer)

    @collective()
    def delete(self, model_id: str) -> None:
        adapter = self.adapters.pop(model_id, None)
        if adapter is not None:
            self.lora.remove_adapter(adapter.name)

    def policy_version(self, model_id: str) -> int:
        """The model's policy version: how many optimizer steps its weights have taken."""
        return self.adapters[model_id].steps

    def _optimizer(self, adapter: Adapter) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
        """What makes the model's optimizer afresh (a load): of its own family, always."""
        return functools.partial(optimizers.new_optimizer, adapter.family, device=self.device,
                                 rank=int(adapter.lora_config["rank"]))

    # ------------------------------------------------------------------ residency

    def _park(self, adapter: Adapter) -> None:
        """Rows out of the slabs to the offload device, optimizer moments with them."""
        self.lora.park(adapter.name, self.offload_device)
        _move_state(adapter, self.offload_device)
        adapter.resident = False

    def _unpark(self, adapter: Adapter) -> None:
        self.lora.restore(adapter.name)
        _move_state(adapter, self.device)
        adapter.resident = True

    @collective()
    def ensure_resident(self, model_ids: Iterable[str]) -> None:
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

    @collective()
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

    # ------------------------------------------------------------------ fused pass

    @collective()
    def run_pass(self, requests: list[PassRequest]) -> list[Outcome]:
        """Run many models' forward/forward_backward requests through one pass over the base.

        Returns one result (Tinker ForwardBackwardOutput JSON) or one error per request, in order.
        The pass is planned on the host (`batcher.engine.plan`), runs on the device without reading
        anything back (`batcher.engine.device_pass`), and its results come back in one copy at the end.
        """
        outcomes, configs, rows = self._admit(requests)
        models = {requests[i].model_id for i in configs}
        self.ensure_resident(models)
        # Models without pending gradients: a failed pass must leave their gradient rows at zero.
        fresh = [self.adapters[m].name for m in models if not self.lora.pending(self.adapters[m].name)]
        started = time.perf_counter()
        if self.data_parallel is not None:  # this rank's share (batcher.engine.data_parallel)
            names = sorted(self.adapters[m].name for m in models)
            result, own = self.data_parallel.run(self.planner, self.device_pass, self.lora, names, rows, requests,
                                                 configs)
            return self._finish(result, requests, outcomes, rows, own, started)
        try:
            batches = self.planner.plan(rows, requests, configs)
            values = self.device_pass.compute(batches, len(requests)).cpu()  # the pass's one read-back
        except Exception as exc:
            if self.gang_size > 1:
                raise  # the ranks may have parted mid-pass: the gang restarts (batcher.engine.gang.GangBroken)
            log.exception("fused pass failed")
            for name in fresh:
                self.lora.discard_grads(name)
            for i in configs:
                outcomes[i] = ServerError(f"trainer pass failed: {type(exc).__name__}: {exc}")
            return _answered(outcomes)
        return self._finish(read_back(batches, values, requests, configs), requests, outcomes, rows, batches, started)

    def _finish(self, result: PassResult, requests: list[PassRequest], outcomes: list[Outcome | None],
                rows: list[Row], batches: list[PlannedBatch], started: float) -> list[Outcome]:
        """Answer the requests from a pass's results; keep or discard its gradients."""
        models = {requests[i].model_id for i in (*result.outputs, *result.not_finite)}
        for i, (datums, backpropagated) in result.not_finite.items():
            outcomes[i] = self._not_finite(requests[i], datums, backpropagated)
        for i, output in result.outputs.items():
            outcomes[i] = output
        for model_id in result.kept_models:
            self.lora.set_grads(self.adapters[model_id].name)
        self.last_pass = PassStats(
            models=len(models),
            rows=len(rows), tokens=sum(len(r.tokens) for r in rows),
            padded_tokens=sum(b.layout.tokens for b in batches), micro_batches=len(batches),
            seconds=time.perf_counter() - started,
        )
        return _answered(outcomes)

    def planned_pass(self, requests: list[PassRequest]) -> Callable[[], torch.Tensor]:
        """A pass's host half done now; the function returned runs only its device half (forward,
        losses, backward), without finishing the requests: what synchronisation checks watch."""
        _, configs, rows = self._admit(requests)
        self.ensure_resident({requests[i].model_id for i in configs})
        if self.data_parallel is not None:  # this rank's share, as a pass of the gang computes it
            batches, _ = self.data_parallel.plan(self.planner, rows, requests, configs)
        else:
            batches = self.planner.plan(rows, requests, configs)
        return lambda: self.device_pass.compute(batches, len(requests))

    def _admit(self, requests: list[PassRequest]) -> tuple[list[Outcome | None], dict[int, LossConfig], list[Row]]:
        """Each request's rows, or its error when its model is not here."""
        outcomes: list[Outcome | None] = [None] * len(requests)
        configs: dict[int, LossConfig] = {}
        rows: list[Row] = []
        for i, req in enumerate(requests):
            if req.model_id not in self.adapters:
                outcomes[i] = ServerError(f"model {req.model_id!r} is not loaded on this trainer")
                continue
            adapter = self.adapters[req.model_id]
            refusal = _custom_refusal(req)
            if refusal is not None:
                outcomes[i] = refusal
                continue
            # The trainer's policy version is the model's optimizer step count.
            configs[i] = dataclasses.replace(req.work.loss_config, current_policy_version=adapter.steps)
            rows += [Row(i, j, d.tokens, d.inputs, adapter.name, d.policy_version, d.width, d.images)
                     for j, d in enumerate(req.work.data)]
        return outcomes, configs, rows

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

    # ------------------------------------------------------------------ optimizer steps

    @collective()
    def optim_step(self, model_id: str, params: OptimParams) -> dict[str, Any]:
        """One model's optimizer step on its accumulated gradients (per-model clipping), then clear them."""
        [outcome] = self.optim_steps([(model_id, params)])
        if isinstance(outcome, QuiltError):
            raise outcome
        return outcome

    @collective()
    def optim_steps(self, steps: list[tuple[str, OptimParams]]) -> list[Outcome]:
        """`optim_step` for several models at once (distinct models: a round's steps), one result or
        one error per model, in order (`batcher.engine.optimizers.take_steps`)."""
        known = [i for i, (model_id, _) in enumerate(steps) if model_id in self.adapters]
        self.ensure_resident([steps[i][0] for i in known])
        taken = iter(optimizers.take_steps(self.lora, [(self.adapters[steps[i][0]], steps[i][1]) for i in known]))
        return [next(taken) if model_id in self.adapters else
                ServerError(f"model {model_id!r} is not loaded on this trainer") for model_id, _ in steps]

    # ------------------------------------------------------------------ files

    @collective()
    def adapter_state(self, model_id: str) -> dict[str, torch.Tensor]:
        """A copy of the adapter's whole weights under PEFT's saved key names (gathered over a gang)."""
        return self.lora.full_state_dict(self.adapters[model_id].name)

    @collective()
    def optimizer_state(self, model_id: str) -> dict[str, Any]:
        """The adapter's optimizer state with whole moments (gathered over a gang)."""
        return adapter_io.optimizer_state(self.lora, self.adapters[model_id])

    @collective(followers="export")
    def save(self, model_id: str, directory: str, *, overwrite: bool, with_optimizer: bool = True) -> int:
        """Write the adapter in PEFT format (what vLLM loads), plus optimizer state for training
        checkpoints; returns bytes written. Atomic: written beside the target, then renamed. The
        other ranks of a gang only take part in gathering it (`export`, not written)."""
        return self.export(model_id, directory, overwrite=overwrite, with_optimizer=with_optimizer)()

    @collective()
    def export(self, model_id: str, directory: str, *, overwrite: bool, with_optimizer: bool = True
               ) -> Callable[[], int]:
        """`save`, in two halves: this call takes what will be written (the weights copied on the
        device, the optimizer state by reference) and checks the target; the function it returns
        writes it, from any thread. Until that has returned, nothing may change the adapter's
        optimizer state in place: no optim_step and no load of this model (the loop's barrier table
        keeps to that)."""
        self.ensure_resident([model_id])
        adapter = self.adapters[model_id]
        dest = Path(directory)
        if dest.exists() and not overwrite:
            raise Conflict(f"checkpoint {dest.name!r} already exists; pass overwrite=True to replace it", field="path")
        # Copies: a resident adapter's tensors are views of slab rows, which parking this adapter would
        # hand to another while the writer still reads them.
        return adapter_io.writer(dest, self.adapter_state(model_id),
                                 adapter_io.peft_config(adapter, self.config, self.base_path),
                                 self.optimizer_state(model_id) if with_optimizer else None,
                                 TrainerMeta(dict(adapter.lora_config), adapter.steps, adapter.family))

    @collective()
    def snapshot(self, model_id: str, directory: str) -> int:
        """Write the model's durable state (batcher.snapshots) into `directory`; returns bytes written.
        One process writes a training checkpoint (`save`); a gang writes each rank's shares with
        torch.distributed.checkpoint (batcher.engine.sharded_snapshots: a collective, nothing gathered)."""
        if self.gang_size == 1:
            return self.save(model_id, directory, overwrite=True, with_optimizer=True)
        self.ensure_resident([model_id])
        return sharded_snapshots.save(self.lora, self.adapters[model_id], directory)

    def load_snapshot(self, model_id: str, directory: str) -> None:
        """Load a snapshot of either kind into an existing model of the same LoRA shape (a sharded
        one written by a gang of any size, resharded here)."""
        if sharded_snapshots.is_sharded(directory):
            self.load_sharded(model_id, directory)
        else:
            self.load(model_id, directory, optimizer=True)

    @collective()
    def load_sharded(self, model_id: str, directory: str) -> None:
        """Load a sharded snapshot, every rank its own shares (batcher.engine.sharded_snapshots)."""
        self.ensure_resident([model_id])
        adapter = self.adapters[model_id]
        sharded_snapshots.load(self.lora, adapter, directory, self._optimizer(adapter))

    def load(self, model_id: str, directory: str, *, optimizer: bool) -> None:
        """Load a checkpoint into an existing model with the same LoRA shape; clears gradients.
        Without `optimizer`, the optimizer starts fresh (Tinker's load_state semantics). Only this
        process reads the files: in a gang, rank 0, which hands what it read to the others."""
        self.load_saved(model_id, adapter_io.read_saved(directory, optimizer=optimizer))

    @collective()
    def load_saved(self, model_id: str, saved: adapter_io.Saved) -> None:
        """`load`, from a checkpoint already read."""
        self.ensure_resident([model_id])
        adapter = self.adapters[model_id]
        adapter_io.load_saved(self.lora, adapter, saved, self._optimizer(adapter))


def _custom_refusal(req: PassRequest) -> UserError | None:
    """Why a request's custom loss cannot run on its datums' shapes (`custom_losses.check`, nothing
    allocated), or None: refused here, it never reaches the pass the other requests share."""
    graph = req.work.custom
    if graph is None:
        return None
    seen: set[tuple[Any, ...]] = set()
    for j, d in enumerate(req.work.data):
        datum = custom_losses.CustomDatum(0, 0, len(d.tokens), d.width, graph,
                                          custom_losses.input_tensors(graph, d.inputs, len(d.tokens)))
        shapes = (datum.n, datum.width, *(tuple(t.shape) for t in datum.inputs))
        why = None if shapes in seen else custom_losses.check(datum)
        if why is not None:
            return UserError(f"data[{j}]: {why}", field="forward_backward_input.loss_fn_config.loss_id")
        seen.add(shapes)
    return None


def _answered(outcomes: list[Outcome | None]) -> list[Outcome]:
    """Every request's outcome: an error at admission, or the pass's answer for it."""
    if any(o is None for o in outcomes):
        raise RuntimeError("a fused pass left a request unanswered")
    return cast(list[Outcome], outcomes)


def _move_state(adapter: Adapter, device: torch.device) -> None:
    for state in adapter.optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":
                state[key] = value.to(device)


def _load_kwargs(arch: architectures.Architecture, config: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """from_pretrained's arguments for a trainer's base beyond its dtype."""
    kw: dict[str, Any] = {}
    if arch.moe and dtype == torch.float64:
        kw["experts_implementation"] = "eager"  # grouped_mm has no float64 kernel (float64 is for tests)
    if architectures.checkpoint_quantization(config) == "mxfp4":
        # Dequantized on every machine: with its MXFP4 kernels transformers swaps the experts for a
        # module without the gate_up_proj/down_proj parameters expert LoRA runs (batcher.engine.expert_lora).
        from transformers.utils.quantization_config import Mxfp4Config

        kw["quantization_config"] = Mxfp4Config(dequantize=True)
    return kw
