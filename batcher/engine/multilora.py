"""Many LoRA adapters on one frozen base, in per-module slabs, each token routed to its own adapter.

Every wrapped Linear keeps, per rank class, one slab of all resident adapters' weights: `A[slots,
rank, in]` and `B[slots, out, rank]` (the float32 masters; float64 in tests), their gradients beside
them (`gA`, `gB`), and on a bfloat16 GPU base a bfloat16 copy for compute, refreshed after optimizer
steps. An adapter is a slot: its parameters are views of its rows, so AdamW, clipping, saving and
loading work on them as on any tensor, while a pass reads the whole slab at once. The last row of a
slab is always zero: padding tokens and adapters that do not target a module are routed there.

Siblings that a decoder feeds one input (q/k/v, gate/up: `SHARED_INPUT`) keep their A rows side by
side in one tensor, `[slots + 1, siblings x rank, in]`, each sibling's slab A a slice of it, so one
shrink serves all of them (`Siblings`): one GEMM, one conversion of the input, and in the backward
one GEMM for the input's gradient and one for the A rows', where each sibling alone would take its
own.

A pass is laid out as runs of flat tokens, one per adapter and stream (`batcher.engine.layout`); a layer's
route for a pass (`Route`) says which slot each run uses (a group of siblings' shrink has its own
route: an adapter's slot wherever it trains any of them). One shrink and one expand cover every run:
batched matmuls with one weight per run when the runs are equally long (the usual fused step of one
small batch per tenant: Punica's SGMV shape, nothing to group), a grouped GEMM over the runs' token
offsets otherwise where the build has one for the dtype (`torch._grouped_mm`: float32 and bfloat16,
CPU and Hopper GPUs), a loop over runs where it has not (float64).
Gradients of the slabs are written by the backward itself into `gA`/`gB` (the pattern of Megatron's
`main_grad`): autograd never sees a per-adapter parameter, so a pass's graph has an expand node per
layer and a shrink node per group of siblings whatever the number of adapters. Each adapter gets
exactly the gradient of a separate pass (summed in another order).

Under a tensor-parallel base (a trainer gang, `batcher.engine.gang`) each layer's LoRA is split as vLLM
splits it (`Split`): a column-parallel layer keeps A whole and holds its share of B's output rows, a
row-parallel layer holds its share of A's input columns and keeps B whole. Two small all-reduces
(tokens x rank each; one for a group of siblings) make that exact: the shrink of a row-parallel
layer in the forward, the shrink's gradient of a column-parallel layer in the backward. Exports
gather the shares.

Adapters are stored and exported in PEFT's format (`base_model.model.<module>.lora_A.weight`,
`adapter_config.json`), which is what vLLM loads and what `peft` reads back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from batcher.engine import expert_lora
from batcher.engine.grouped import (
    PassContext,
    Route,
    Shrunk,
    Slab,
    Split,
    accumulate,
    compute_dtype,
    groupable,
    grouped_mm,
)

# Sibling Linears that the supported decoders call on one input (attention's q/k/v, the gated MLP's
# gate/up, latent attention's two down-projections, Qwen3.5's linear attention's four input projections):
# their A slabs lie side by side in one tensor, so one shrink serves them all.
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("q_a_proj", "kv_a_proj_with_mqa"),
                ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))


@dataclass
class SharedA:
    """One rank's A of a group of siblings, side by side: `[slots + 1, siblings x rank, in]`."""

    A: torch.Tensor
    gA: torch.Tensor
    A_c: torch.Tensor
    trigger: torch.Tensor  # the autograd leaf that makes backward reach the group's layers
    scale: float
    rank: int


def _new_slabs(capacity: int, rank: int, layers: list[Layer], master: torch.dtype, compute: torch.dtype,
               scale: float) -> tuple[SharedA, list[Slab]]:
    """A group of siblings' slabs of one rank (a group of one for a lone layer or an experts part):
    their A rows are slices of one shrink tensor."""
    dev = layers[0].device
    shape_a = (capacity + 1, *layers[0].shapes(rank)[0])
    wide = (*shape_a[:-2], len(layers) * rank, shape_a[-1])
    A = torch.zeros(wide, dtype=master, device=dev)
    shrink = SharedA(A, torch.zeros_like(A), A if compute == master else A.to(compute),
                     torch.zeros((), device=dev, requires_grad=True), scale, rank)
    slabs = []
    for i, layer in enumerate(layers):
        B = torch.zeros((capacity + 1, *layer.shapes(rank)[1]), dtype=master, device=dev)
        part = [t.narrow(-2, i * rank, rank) for t in (shrink.A, shrink.gA, shrink.A_c)]
        slabs.append(Slab(part[0], B, part[1], torch.zeros_like(B), part[2],
                           B if compute == master else B.to(compute), scale))
    return shrink, slabs


def _mode(route: Route, x2: torch.Tensor, *sizes: int) -> str:
    """How a shrink or an expand multiplies its runs: "grouped" always for a captured pass's route,
    "equal" (batched matmuls) for runs of one length, "grouped" where the strides allow it, else
    "loop"."""
    if route.static:
        return "grouped"
    if route.equal:
        return "equal"
    return "grouped" if groupable(x2, *sizes, x2.shape[0]) else "loop"


class Siblings:
    """Layers of one parent fed the same input (`SHARED_INPUT`; a lone layer is a group of one): per
    rank one `SharedA` of their A's side by side. The first sibling a pass calls shrinks the input
    for all of them (one GEMM; one conversion of the input to the compute dtype), the others take
    their slices, matched by the input's identity: a sibling called on another tensor, or twice,
    shrinks again by itself, so a model that does not feed them one input is still exact."""

    def __init__(self, members: list[MultiLoraLinear], context: PassContext):
        self.members = members
        self.context = context
        # The route key of the group's shrink: the union of its members' routes.
        self.kind = "+".join(m.kind for m in members)
        self.shrinks: dict[int, SharedA] = {}
        for i, m in enumerate(members):
            m.siblings, m.sibling = self, i

    def take(self, layer: MultiLoraLinear, x: torch.Tensor, rank: int) -> torch.Tensor:
        """This layer's `scale * x @ A.T` for every token (its slot's A), [tokens, rank]."""
        routes, key = self.context.routes or {}, (self, rank)
        shrunk = self.context.shrunk.get(key)
        if shrunk is None or shrunk.x is not x or layer.sibling in shrunk.taken:
            route = routes[(self.kind, rank)]
            shrink = self.shrinks[rank]
            shrunk = Shrunk(x, Shrink.apply(x, route, shrink, layer.split, shrink.trigger))
            self.context.shrunk[key] = shrunk
        shrunk.taken.add(layer.sibling)
        # Forgotten once every sibling with a route has read it: a pass without autograd keeps no
        # layer's input beyond its siblings.
        if all(m.sibling in shrunk.taken for m in self.members if (m.kind, rank) in routes):
            del self.context.shrunk[key]
        return shrunk.parts[layer.sibling]


class MultiLoraLinear(nn.Module):
    """Wraps a frozen Linear; holds the slabs of every rank class for it."""

    device: torch.device
    dtype: torch.dtype
    siblings: Siblings

    def __init__(self, base: nn.Linear, name: str, context: PassContext, split: Split | None = None):
        super().__init__()
        self.base = base
        self.kind = name  # the target name (q_proj, ..., lm_head): routes are per kind
        self.context = context
        self.split = split
        # This rank's sizes (a tensor-parallel base's layer keeps its whole sizes in in/out_features).
        self.in_features = base.in_features // split.count if split and split.dim == "in" else base.in_features
        self.out_features = base.out_features // split.count if split and split.dim == "out" else base.out_features
        self.slabs: dict[int, Slab] = {}  # not registered: the base's parameters stay the base's
        # A distributed base layer's output is a view its DTensor made (`to_local`), which autograd
        # does not let a custom Function change in place: the LoRA adds into a copy of it.
        self.copy_output = isinstance(base.weight, DTensor)
        self.device, self.dtype = base.weight.device, base.weight.dtype
        self.sibling = 0
        Siblings([self], context)  # alone until MultiLoraModel groups it with its siblings (sets `siblings`)

    # What MultiLoraModel keeps slabs through (batcher.engine.expert_lora.ExpertPart has the same).

    def shapes(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One adapter's A and B on this rank."""
        return (rank, self.in_features), (self.out_features, rank)

    def whole_A(self, rank: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
        """PEFT's initialisation of A (Kaiming-uniform, a=sqrt(5)), drawn whole on every rank of a
        gang, so each share is the single trainer's."""
        bound = math.sqrt(6.0 / ((1 + 5) * self.base.in_features))
        return torch.empty(rank, self.base.in_features, dtype=dtype).uniform_(-bound, bound, generator=generator)

    def peft(self, path: str, A: torch.Tensor, B: torch.Tensor) -> dict[str, torch.Tensor]:
        """Whole factors under PEFT's saved names."""
        return {f"base_model.model.{path}.lora_A.weight": A, f"base_model.model.{path}.lora_B.weight": B}

    def unpeft(self, path: str, state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole factors from PEFT's tensors (KeyError where one is missing)."""
        return state[f"base_model.model.{path}.lora_A.weight"], state[f"base_model.model.{path}.lora_B.weight"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        routes = self.context.routes
        if not routes:
            return y
        if self.copy_output and torch.is_grad_enabled():
            y = y.clone()
        for rank, slab in self.slabs.items():
            route = routes.get((self.kind, rank))
            if route is not None:
                y = Expand.apply(y, self.siblings.take(self, x, rank), route, slab)
        return y


class Shrink(torch.autograd.Function):
    """`xa[t] = scale * x[t] @ A[s(t)].T` for every token t, s(t) its run's slot, for a group of
    siblings at once (their A's side by side: one GEMM, [tokens, siblings x rank]), returned as one
    [tokens, rank] slice per sibling; the backward adds each slot's gradient into the group's `gA`
    rows and returns only the input's (one GEMM for all siblings).

    The scale applies to the rank-sized intermediate. Under a row-parallel split ("in") the shrink
    is summed over the tensor-parallel group; under a column-parallel one ("out") its gradient is,
    before the gradients of A and of the input are taken."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, route: Route, shrink: SharedA, split: Split | None,
                trigger: torch.Tensor) -> tuple[torch.Tensor, ...]:
        A_c = shrink.A_c
        x2 = x.reshape(-1, x.shape[-1]).to(A_c.dtype)
        mode = _mode(route, x2, shrink.rank, A_c.shape[2])
        A_g = None
        if mode != "loop":
            offsets, slots = route.device()
        if mode == "equal":
            A_g = A_c.index_select(0, slots)
            xa = torch.bmm(x2.view(len(route.runs), -1, x2.shape[1]), A_g.transpose(1, 2)).mul_(shrink.scale)
            xa = xa.view(-1, xa.shape[2])
        elif mode == "grouped":
            A_g = A_c.index_select(0, slots)
            xa = grouped_mm(x2, A_g.transpose(1, 2), offs=offsets).mul_(shrink.scale)
        else:
            xa = x2.new_zeros((x2.shape[0], A_c.shape[1]))
            zero = A_c.shape[0] - 1
            for slot, s, e in route.runs:
                if slot != zero:
                    torch.mm(x2[s:e], A_c[slot].T, out=xa[s:e]).mul_(shrink.scale)
        if split is not None and split.dim == "in":
            split.all_reduce(xa)
        ctx.route, ctx.shrink, ctx.split, ctx.mode, ctx.x_shape, ctx.x_dtype = route, shrink, split, mode, x.shape, x.dtype
        ctx.save_for_backward(x2, A_g)
        return tuple(xa.split(shrink.rank, dim=1))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        x2, A_g = ctx.saved_tensors
        route, shrink, split = ctx.route, ctx.shrink, ctx.split
        h = torch.cat(grads, dim=1).mul_(shrink.scale) if len(grads) > 1 else grads[0] * shrink.scale
        if split is not None and split.dim == "out":
            split.all_reduce(h)
        want_x = ctx.needs_input_grad[0]
        grad_x = None
        if ctx.mode == "equal":
            G = len(route.runs)
            h3 = h.view(G, -1, h.shape[1])
            if want_x:
                grad_x = torch.bmm(h3, A_g)
            accumulate(shrink.gA, route, torch.bmm(h3.transpose(1, 2), x2.view(G, -1, x2.shape[1])))
        elif ctx.mode == "grouped":
            if want_x:
                grad_x = grouped_mm(h, A_g, offs=route.offsets)
            accumulate(shrink.gA, route, grouped_mm(h.T, x2, offs=route.offsets))
        else:
            grad_x = torch.zeros_like(x2) if want_x else None
            zero = shrink.A_c.shape[0] - 1
            for slot, s, e in route.runs:
                if slot == zero:
                    continue
                if grad_x is not None:
                    torch.mm(h[s:e], shrink.A_c[slot], out=grad_x[s:e])
                shrink.gA[slot].addmm_(h[s:e].T.to(shrink.gA.dtype), x2[s:e].to(shrink.gA.dtype))
        if grad_x is not None:
            grad_x = grad_x.view(ctx.x_shape).to(ctx.x_dtype)
        return grad_x, None, None, None, None


class Expand(torch.autograd.Function):
    """`y[t] += xa[t] @ B[s(t)].T` for every token t into the base's output `y` in place (`xa`: the
    layer's slice of its group's `Shrink`); the backward adds each slot's gradient into the slab's
    `gB` rows and returns the gradients of `y` (unchanged) and of `xa`.

    The base's backward never reads `y`, so adding into it is safe, and at the vocabulary-wide
    lm_head it saves an output-sized temporary."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, xa: torch.Tensor, route: Route, slab: Slab) -> torch.Tensor:
        y2 = y.view(-1, y.shape[-1])
        mode = _mode(route, xa, slab.B.shape[2], slab.B.shape[1])
        B_g = None
        if mode == "equal":
            B_g = slab.B_c.index_select(0, route.device()[1])
            xa3 = xa.unflatten(0, (len(route.runs), -1))
            if y2.dtype == xa.dtype:
                y2.view(len(route.runs), -1, y2.shape[1]).baddbmm_(xa3, B_g.transpose(1, 2))
            else:
                y2.add_(torch.bmm(xa3, B_g.transpose(1, 2)).view_as(y2).to(y2.dtype))
        elif mode == "grouped":
            offsets, slots = route.device()
            B_g = slab.B_c.index_select(0, slots)
            y2.add_(grouped_mm(xa, B_g.transpose(1, 2), offs=offsets).to(y.dtype))
        else:
            for slot, s, e in route.runs:
                if slot == slab.zero_slot:
                    continue
                if y2.dtype == xa.dtype:
                    y2[s:e].addmm_(xa[s:e], slab.B_c[slot].T)
                else:
                    y2[s:e].add_((xa[s:e] @ slab.B_c[slot].T).to(y2.dtype))
        ctx.mark_dirty(y)
        ctx.route, ctx.slab, ctx.mode = route, slab, mode
        ctx.save_for_backward(xa, B_g)
        return y

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        xa, B_g = ctx.saved_tensors
        route, slab = ctx.route, ctx.slab
        g = grad_y.reshape(-1, grad_y.shape[-1]).to(xa.dtype).contiguous()  # (a sum's gradient is expanded)
        if ctx.mode == "equal":
            G = len(route.runs)
            g3, xa3 = g.view(G, -1, g.shape[1]), xa.unflatten(0, (G, -1))
            grad_xa = torch.bmm(g3, B_g).view(-1, B_g.shape[2])
            # (xa.T @ g).T: the output-wide operand read in its own layout, not copied transposed
            accumulate(slab.gB, route, torch.bmm(xa3.transpose(1, 2), g3).transpose(1, 2))
        elif ctx.mode == "grouped":
            grad_xa = grouped_mm(g, B_g, offs=route.offsets)
            accumulate(slab.gB, route, grouped_mm(g.T, xa, offs=route.offsets))
        else:
            grad_xa = torch.zeros_like(xa)
            for slot, s, e in route.runs:
                if slot == slab.zero_slot:
                    continue
                torch.mm(g[s:e], slab.B_c[slot], out=grad_xa[s:e])
                slab.gB[slot].addmm_(g[s:e].T.to(slab.gB.dtype), xa[s:e].to(slab.gB.dtype))
        return grad_y, grad_xa, None, None


# A layer the slabs are kept through: a wrapped Linear, or one projection of a MoE block's experts.
Layer = MultiLoraLinear | expert_lora.ExpertPart


@dataclass
class _RankClass:
    """The slots of one rank: which adapter holds which row of every slab of this rank."""

    rank: int
    scale: float
    capacity: int = 0
    slot_of: dict[str, int] = field(default_factory=dict)
    free: list[int] = field(default_factory=list)
    dirty: bool = False  # masters changed since the compute copies were refreshed


@dataclass
class _AdapterSlots:
    rank: int
    kinds: frozenset[str]  # target names it trains
    params: list[torch.Tensor]  # [A, B] per targeted layer, in model order: views of its slot rows when resident
    layers: list[str]  # the layer path of each params pair


class MultiLoraModel:
    """A causal LM whose target Linears are wrapped for slab multi-LoRA."""

    def __init__(self, model: nn.Module, target_names: tuple[str, ...], splits: dict[str, Split] | None = None,
                 shared_input: tuple[tuple[str, ...], ...] = SHARED_INPUT):
        """`splits`: the share of each split layer (and experts module), by path (`batcher.engine.gang.splits`).
        A target name "experts" puts LoRA on every MoE block's experts (`batcher.engine.expert_lora`).
        `shared_input`: the groups of sibling names that share one shrink (none: a shrink per layer)."""
        self.model = model
        self.context = PassContext()
        self.layers: dict[str, Layer] = {}
        splits = splits or {}
        for path, module in list(model.named_modules()):
            if isinstance(module, nn.Linear) and path.rsplit(".", 1)[-1] in target_names:
                parent_path, _, attr = path.rpartition(".")
                parent = model.get_submodule(parent_path) if parent_path else model
                wrapped = MultiLoraLinear(module, attr, self.context, splits.get(path))
                setattr(parent, attr, wrapped)
                self.layers[path] = wrapped
        if "experts" in target_names:
            self.layers.update(expert_lora.wrap(model, self.context, splits))
        self.groups = self._groups(shared_input)
        # The shared shrinks' route keys and the kinds each covers (every layer of a kind shares one route).
        self.shared_kinds: dict[str, frozenset[str]] = {}
        for paths in self.groups:
            if len(paths) > 1:  # (only Linears are grouped: `_groups`)
                siblings = Siblings([_linear(self.layers[p]) for p in paths], self.context)
                self.shared_kinds[siblings.kind] = frozenset(m.kind for m in siblings.members)
        first = next(iter(self.layers.values()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.master_dtype = torch.promote_types(first.dtype, torch.float32) if first is not None else torch.float32
        self.compute_dtype = compute_dtype(first.dtype, self.device) if first is not None else torch.float32
        self.classes: dict[int, _RankClass] = {}
        self.adapters: dict[str, _AdapterSlots] = {}
        self.max_slots = 0  # slabs grow by doubling up to this many slots (the memory plan's residents); 0: no cap
        # Counts every (re)allocation of slabs: a captured pass reads the slabs where they were.
        self.generation = 0

    def _groups(self, shared_input: tuple[tuple[str, ...], ...]) -> list[list[str]]:
        """The layers' paths in the groups whose slabs are allocated together: the siblings of one
        parent fed one input (`shared_input`, of one width and split) share their A tensor and their
        shrink; every other layer (an experts part too) is a group of one."""
        groups: list[list[str]] = []
        by: dict[tuple[str, tuple[str, ...], int, str | None], list[str]] = {}
        for path, layer in self.layers.items():
            names = next((g for g in shared_input if layer.kind in g), None)
            if names is None or not isinstance(layer, MultiLoraLinear):
                groups.append([path])
                continue
            key = (path.rpartition(".")[0], names, layer.in_features, layer.split.dim if layer.split else None)
            if key not in by:
                by[key] = []
                groups.append(by[key])
            by[key].append(path)
        return groups

    # ------------------------------------------------------------------ slots

    def add_adapter(self, name: str, *, rank: int, alpha: float, targets: list[str], seed: int) -> list[torch.Tensor]:
        """A new adapter in a free slot of its rank's slabs: PEFT's initialisation (Kaiming-uniform A,
        zero B, so it changes nothing yet). Returns its parameters, [A, B] per targeted layer."""
        g = torch.Generator().manual_seed(seed)
        cls = self.classes.get(rank)
        if cls is None:
            cls = self.classes[rank] = _RankClass(rank, alpha / rank)
        elif cls.scale != alpha / rank:
            raise ValueError(f"rank {rank} already has alpha {cls.scale * rank}, not {alpha}")
        params, layers = [], []
        for path, layer in self.layers.items():
            if layer.kind in targets:
                A = layer.whole_A(rank, self.master_dtype, g)
                if layer.split is not None:
                    A = layer.split.local(A, layer.split.axis("A")).clone()
                params += [A.to(self.device), torch.zeros(layer.shapes(rank)[1], dtype=self.master_dtype,
                                                          device=self.device)]
                layers.append(path)
        self.adapters[name] = _AdapterSlots(rank, frozenset(targets), params, layers)
        self.restore(name)
        return params

    def remove_adapter(self, name: str) -> None:
        if name in self.adapters:
            self._release(name)
            del self.adapters[name]

    def order(self, name: str) -> tuple[int, int]:
        """Where a resident adapter's rows lie: passes lay rows out in this order, so each layer's
        runs take consecutive slots."""
        rank = self.adapters[name].rank
        return rank, self.classes[rank].slot_of[name]

    def resident(self, name: str) -> bool:
        return name in self.classes[self.adapters[name].rank].slot_of

    def park(self, name: str, device: torch.device) -> None:
        """Copy an adapter's rows (and gradients) out of the slabs to `device` and free its slot."""
        ad = self.adapters[name]
        if not self.resident(name):
            return
        for p in ad.params:
            p.data = p.data.to(device, copy=True)
            if p.grad is not None:
                p.grad = p.grad.to(device, copy=True)
        self._release(name)

    def restore(self, name: str) -> None:
        """Put a parked (or new) adapter into a free slot; its parameters become views of the rows."""
        ad = self.adapters[name]
        cls = self.classes[ad.rank]
        if name in cls.slot_of:
            return
        if not cls.free:
            self._grow(cls)
        slot = cls.free.pop(0)
        cls.slot_of[name] = slot
        for path, A, B in zip(ad.layers, ad.params[0::2], ad.params[1::2]):
            slab = self.layers[path].slabs[ad.rank]
            slab.A[slot].copy_(A.data)
            slab.B[slot].copy_(B.data)
            grads = A.grad, B.grad
            A.data, B.data = slab.A[slot], slab.B[slot]
            if grads[0] is not None and grads[1] is not None:
                slab.gA[slot].copy_(grads[0])
                slab.gB[slot].copy_(grads[1])
                A.grad, B.grad = slab.gA[slot], slab.gB[slot]
        cls.dirty = True

    def _release(self, name: str) -> None:
        ad = self.adapters[name]
        cls = self.classes[ad.rank]
        slot = cls.slot_of.pop(name, None)
        if slot is None:
            return
        cls.dirty = True
        if not cls.slot_of:  # nothing of this rank resident: its slabs' memory goes back
            for layer in self.layers.values():
                del layer.slabs[cls.rank]
                if isinstance(layer, MultiLoraLinear):
                    layer.siblings.shrinks.pop(cls.rank, None)
            self.generation += 1
            cls.capacity, cls.free = 0, []
            return
        for layer in self.layers.values():
            slab = layer.slabs[ad.rank]
            for t in (slab.A, slab.B, slab.gA, slab.gB):
                t[slot].zero_()
        cls.free.append(slot)
        cls.free.sort()

    def _grow(self, cls: _RankClass) -> None:
        """Twice the slots (at least one more; no more than `max_slots` unless a pass needs them) in
        every slab of the rank; resident adapters rebind to the new rows."""
        old = cls.capacity
        cls.capacity = max(1, 2 * old)
        if self.max_slots:
            cls.capacity = max(old + 1, min(cls.capacity, self.max_slots))
        # Group by group, rebinding as it goes, so only one group's old slabs are alive beside its
        # new ones (all at once, a large base's growth would briefly need both sets of slabs).
        views = {name: dict(zip(self.adapters[name].layers, zip(self.adapters[name].params[0::2],
                                                               self.adapters[name].params[1::2])))
                 for name in cls.slot_of}
        for paths in self.groups:
            layers = [self.layers[p] for p in paths]
            shrink, slabs = _new_slabs(cls.capacity, cls.rank, layers, self.master_dtype, self.compute_dtype,
                                       cls.scale)
            if isinstance(layers[0], MultiLoraLinear):
                layers[0].siblings.shrinks[cls.rank] = shrink
            for path, layer, slab in zip(paths, layers, slabs):
                if old:
                    previous = layer.slabs[cls.rank]
                    for new, was in ((slab.A, previous.A), (slab.B, previous.B), (slab.gA, previous.gA),
                                     (slab.gB, previous.gB)):
                        new[:old].copy_(was[:old])
                layer.slabs[cls.rank] = slab
                for name, slot in cls.slot_of.items():
                    pair = views[name].get(path)
                    if pair is None:
                        continue
                    A, B = pair
                    A.data, B.data = slab.A[slot], slab.B[slot]
                    if A.grad is not None:
                        A.grad, B.grad = slab.gA[slot], slab.gB[slot]
        cls.free += range(old, cls.capacity)
        cls.dirty = True
        self.generation += 1

    def set_grads(self, name: str) -> None:
        """Expose a resident adapter's accumulated gradient rows as its parameters' `.grad`."""
        ad = self.adapters[name]
        slot = self.classes[ad.rank].slot_of[name]
        for path, A, B in zip(ad.layers, ad.params[0::2], ad.params[1::2]):
            slab = self.layers[path].slabs[ad.rank]
            if A.grad is None:
                A.grad, B.grad = slab.gA[slot], slab.gB[slot]

    def grad_rows(self, name: str) -> list[torch.Tensor]:
        """A resident adapter's gradient rows in the slabs, exposed or not ([gA, gB] per layer): what
        a data-parallel gang sums over its ranks (`batcher.engine.data_parallel`)."""
        ad = self.adapters[name]
        slot = self.classes[ad.rank].slot_of[name]
        out = []
        for path in ad.layers:
            slab = self.layers[path].slabs[ad.rank]
            out += [slab.gA[slot], slab.gB[slot]]
        return out

    def pending(self, name: str) -> bool:
        """Whether the adapter has accumulated gradients (exposed as `.grad`)."""
        return any(p.grad is not None for p in self.adapters[name].params)

    def discard_grads(self, name: str) -> None:
        """Drop every gradient of a resident adapter, this pass's unexposed rows included."""
        self.set_grads(name)
        self.clear_grads(name)

    def clear_grads(self, name: str) -> None:
        """Drop an adapter's gradients: rows zeroed (the next pass accumulates from zero), `.grad` None."""
        params = self.adapters[name].params
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)  # one call, not a kernel per tensor
        for p in params:
            p.grad = None

    def changed(self, name: str) -> None:
        """An adapter's masters changed (a step, a load): compute copies refresh before the next pass."""
        self.classes[self.adapters[name].rank].dirty = True

    # ------------------------------------------------------------------ a pass

    def routes(self, runs: list[tuple[str | None, int, int]], kinds: tuple[str, ...]
               ) -> dict[tuple[str, int], tuple[tuple[int, int, int], ...]]:
        """Host-side routes of a pass for these runs of tokens and layer kinds: (kind, rank) ->
        (slot, start, end) runs, only where some adapter of that rank trains that kind; and for each
        group of siblings among those kinds (`Siblings.kind`, "q_proj+k_proj+v_proj"), the route of
        their shared shrink: an adapter's slot wherever it trains any of them (its rows of those it
        does not train are zero, and their expands send its tokens to the zero row). Every adapter
        must be resident."""
        present = {a for a, _, _ in runs if a is not None}
        wanted = [(kind, frozenset({kind})) for kind in kinds]
        wanted += [(key, members) for key, members in self.shared_kinds.items() if members <= set(kinds)]
        out = {}
        for rank, cls in self.classes.items():
            mine = [a for a in present if self.adapters[a].rank == rank]
            zero = cls.capacity
            for key, targets in wanted:
                trains = {a for a in mine if targets & self.adapters[a].kinds}
                if not trains:
                    continue
                merged: list[tuple[int, int, int]] = []
                for a, s, e in runs:
                    slot = cls.slot_of[a] if a in trains else zero
                    if merged and merged[-1][0] == slot and merged[-1][2] == s:
                        merged[-1] = (slot, merged[-1][1], e)
                    else:
                        merged.append((slot, s, e))
                out[(key, rank)] = tuple(merged)
        return out

    def grouped_everywhere(self, tokens: list[int]) -> bool:
        """Whether every slab runs grouped GEMM over each of these token counts (the grid's and the
        head chunks'): the compute dtype and every stride allow it."""
        probe = torch.empty(0, dtype=self.compute_dtype, device=self.device)
        for layer in self.layers.values():
            if not isinstance(layer, MultiLoraLinear):
                return False
            for rank in layer.slabs:
                if not groupable(probe, rank, layer.in_features, layer.out_features, *tokens):
                    return False
        return True

    def refresh(self) -> None:
        """Compute copies of the classes whose masters changed (bfloat16 GPU bases only), in one
        call per class."""
        for rank, cls in self.classes.items():
            if cls.dirty and self.compute_dtype != self.master_dtype:
                slabs = [layer.slabs[rank] for layer in self.layers.values()]
                # (the siblings' A slices tile their group's shrink tensor: copying them copies it)
                torch._foreach_copy_([s.A_c for s in slabs] + [s.B_c for s in slabs],
                                     [s.A for s in slabs] + [s.B for s in slabs])
            cls.dirty = False

    # ------------------------------------------------------------------ PEFT format

    def shares(self, name: str) -> list[tuple[Split | None, int | None]]:
        """Per parameter of an adapter ([A, B] per layer): its layer's split and the split axis."""
        out = []
        for path in self.adapters[name].layers:
            split = self.layers[path].split
            out += [(split, split.axis("A") if split else None), (split, split.axis("B") if split else None)]
        return out

    def full_state_dict(self, name: str) -> dict[str, torch.Tensor]:
        """One adapter's tensors under PEFT's saved key names, as whole, independent copies: shares
        gathered over the gang (a collective: every rank calls it), what PEFT, vLLM and a gang of
        any size read."""
        ad = self.adapters[name]
        shares = self.shares(name)
        out = {}
        for i, path in enumerate(ad.layers):
            (split_a, axis_a), (split_b, axis_b) = shares[2 * i], shares[2 * i + 1]
            out.update(self.layers[path].peft(path, gather(split_a, ad.params[2 * i].detach(), axis_a),
                                              gather(split_b, ad.params[2 * i + 1].detach(), axis_b)))
        return out

    def load_state_dict(self, name: str, state: dict[str, torch.Tensor]) -> None:
        """Copy whole PEFT-format tensors into an existing adapter of the same shape (ValueError
        otherwise); under a split base each rank keeps its share."""
        ad = self.adapters[name]
        try:
            whole = [t for path in ad.layers for t in self.layers[path].unpeft(path, state)]
        except KeyError as exc:
            raise ValueError(f"checkpoint tensors do not match the model: missing {exc.args[0]}") from None
        known: set[str] = set()
        for i, path in enumerate(ad.layers):
            known |= self.layers[path].peft(path, whole[2 * i], whole[2 * i + 1]).keys()
        if state.keys() - known:
            raise ValueError(f"checkpoint tensors do not match the model: extra {sorted(state.keys() - known)[:2]}")
        local = []
        for i, (param, t, (split, axis)) in enumerate(zip(ad.params, whole, self.shares(name))):
            shape = list(param.shape)
            if split is not None and axis is not None:
                shape[axis] *= split.count
            if list(t.shape) != shape:
                raise ValueError(f"{ad.layers[i // 2]} lora_{'AB'[i % 2]}: checkpoint shape {tuple(t.shape)} "
                                 f"!= {tuple(shape)}")
            local.append(split.local(t, axis) if split else t)
        with torch.no_grad():
            for param, t in zip(ad.params, local):
                param.copy_(t)
        self.changed(name)


def _linear(layer: Layer) -> MultiLoraLinear:
    if not isinstance(layer, MultiLoraLinear):
        raise TypeError(f"{layer.kind} is not a wrapped Linear")
    return layer


def gather(split: Split | None, t: torch.Tensor, axis: int | None) -> torch.Tensor:
    """A whole, independent copy of a tensor that may be a rank's share."""
    return split.gather(t, axis) if split is not None and axis is not None else t.clone()
