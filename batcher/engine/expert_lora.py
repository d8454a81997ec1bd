"""LoRA on a mixture-of-experts block's experts: one adapter per (slot, expert), in slabs.

transformers 5 keeps a MoE block's experts fused: `gate_up_proj` [E, 2I, H] and `down_proj`
[E, H, I], applied by an "experts implementation" its `ExpertsInterface` picks by name. Quilt
registers its own, "quilt_lora", which is the grouped forward of transformers' own `grouped_mm`
implementation with a LoRA added to each expert's gate, up and down projection:

    gate_up[p] = x[p] @ W_gu[e].T + concat(s * x[p] @ A_g[a,e].T @ B_g[a,e].T, ... up ...)
    out[p]     = act(gate) * up @ W_d[e].T + s * mid[p] @ A_d[a,e].T @ B_d[a,e].T

for every (token, chosen expert) pair p, e its expert and a the slot of the token's adapter. The
pairs are sorted once, by (expert, adapter): the base's grouped GEMM (a group per expert) and the
LoRA's (a group per expert and adapter of the pass, one weight each, taken from the slabs' rows)
run on the same sorted rows, which go back to token order once at the end. Without an adapter on
the experts in a pass, the base's own implementation runs unchanged.

Each projection is a part (`ExpertPart`) with the interface of `multilora.MultiLoraLinear` that
`MultiLoraModel` keeps slabs through: an adapter's parameters are [E, r, in] and [E, out, r] views
of its slot's rows. Gradients reach the slabs' `gA`/`gB` through an autograd leaf that aliases the
compute copy for one pass (`_Leaf`); its gradient is added in and dropped as soon as it is whole.

Under expert parallelism (a trainer gang's "ep": each rank holds E / ranks experts and the router
chooses among all of them) each rank holds the LoRA of its own experts (`Split("experts")`), and each
MoE block dispatches the tokens (`batcher.engine.dispatch`): every rank sends its share of the
tokens' (token, expert) pairs to the experts' ranks, with each pair's member index of every rank
class, so that the receiving rank applies the right adapter's LoRA to each row it received
(`_expert_rows`); the outputs come back by the reverse all-to-all. An expert's gradient is whole on
its rank, since every pair that chose it was computed there. A tensor-parallel gang splits each
expert's width, which this layout does not follow: it refuses expert LoRA.

Exports name each expert's factors as published MoE checkpoints do
(`model.layers.L.mlp.experts.{e}.gate_proj.lora_A.weight`), what vLLM's fused-MoE LoRA loads and
what `checkpoints.adapter_merge` merges into the per-expert weights of the saved base.

Experts stored transposed ([E, in, out]: gpt-oss, whose checkpoints keep the fused 3-D weights and
whose gate and up columns interleave, with a bias on each expert) take LoRA as PEFT's
`target_parameters` puts it on those weights, and as vLLM loads it for such a model
(`is_3d_moe_weight`): one part on the fused `gate_up_proj` (its B's rows in the weight's own
interleaved column order) and one on `down_proj`, exported as PEFT's nested wrappers name them
(`mlp.experts.base_layer.lora_A.weight` [E*r, H] for gate_up, `mlp.experts.lora_A.weight` for down;
each B [out, r*E], expert-minor). The experts' biases are the base's and stay frozen.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from batcher.engine import dispatch, grouped

IMPLEMENTATION = "quilt_lora"
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
FUSED_PROJECTIONS = ("gate_up_proj", "down_proj")  # experts stored transposed: LoRA on the 3-D weights
# PEFT's names for a fused 3-D part: target_parameters nest, gate_up's wrapper inside down's
_FUSED_PEFT = {"gate_up_proj": ".base_layer", "down_proj": ""}


def projections(experts: nn.Module) -> tuple[str, ...]:
    """The parts an experts module's LoRA has: gate, up and down, or, stored transposed (gpt-oss),
    the fused gate_up and down as its checkpoint and PEFT's target_parameters hold them."""
    return FUSED_PROJECTIONS if getattr(experts, "is_transposed", False) else PROJECTIONS


class ExpertPart:
    """One projection of one experts module, as MultiLoraModel keeps it: slabs per rank class of
    A [slots + 1, E, r, in] and B [slots + 1, E, out, r] (E: this rank's experts)."""

    def __init__(self, experts: nn.Module, proj: str, split: grouped.Split | None):
        self.kind = "experts"
        self.proj = proj
        self.split = split
        weight = _param(experts, "down_proj")  # (an FSDP-sharded base's at rest: its whole shape is what counts)
        self.whole_experts, hidden, inter = (int(n) for n in weight.shape)
        self.fused = proj in _FUSED_PEFT and getattr(experts, "is_transposed", False)
        if getattr(experts, "is_transposed", False):  # [E, I, H]
            hidden, inter = inter, hidden
        self.experts = self.whole_experts // (split.count if split else 1)  # this rank's
        self.in_features, self.out_features = ((inter, hidden) if proj == "down_proj"
                                               else (hidden, 2 * inter if proj == "gate_up_proj" else inter))
        self.device, self.dtype = weight.device, weight.dtype
        self.slabs: dict[int, grouped.Slab] = {}

    def shapes(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.experts, rank, self.in_features), (self.experts, self.out_features, rank)

    def whole_A(self, rank: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
        """PEFT's initialisation of every expert's A (Kaiming-uniform, a=sqrt(5)), all experts of
        the base drawn in order, so any split takes its share of the same draw."""
        bound = math.sqrt(6.0 / ((1 + 5) * self.in_features))
        return torch.empty(self.whole_experts, rank, self.in_features, dtype=dtype).uniform_(-bound, bound,
                                                                                         generator=generator)

    def peft(self, path: str, A: torch.Tensor, B: torch.Tensor) -> dict[str, torch.Tensor]:
        """Whole [E, r, in] / [E, out, r] factors under each expert's PEFT names (a fused part: under
        PEFT's names of a target parameter)."""
        block = path.rpartition(".")[0]
        if self.fused:
            name = f"base_model.model.{block}{_FUSED_PEFT[self.proj]}"
            return {f"{name}.lora_A.weight": A.reshape(-1, A.shape[-1]),
                    f"{name}.lora_B.weight": B.permute(1, 2, 0).reshape(B.shape[1], -1)}
        out = {}
        for e in range(A.shape[0]):
            out[f"base_model.model.{block}.{e}.{self.proj}.lora_A.weight"] = A[e]
            out[f"base_model.model.{block}.{e}.{self.proj}.lora_B.weight"] = B[e]
        return out

    def unpeft(self, path: str, state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole factors from each expert's PEFT tensors (KeyError where one is missing)."""
        block = path.rpartition(".")[0]
        if self.fused:
            name = f"base_model.model.{block}{_FUSED_PEFT[self.proj]}"
            a, b = state[f"{name}.lora_A.weight"], state[f"{name}.lora_B.weight"]
            E = self.whole_experts
            if a.shape[0] % E or b.shape[1] != a.shape[0]:
                raise ValueError(f"{name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not {E} experts' factors")
            return a.reshape(E, -1, a.shape[1]), b.reshape(b.shape[0], -1, E).permute(2, 0, 1)
        pair = []
        for which in ("A", "B"):
            tensors = [state[f"base_model.model.{block}.{e}.{self.proj}.lora_{which}.weight"]
                       for e in range(self.whole_experts)]
            if len({tuple(t.shape) for t in tensors}) != 1:
                raise ValueError(f"{block}.*.{self.proj} lora_{which}: the experts' tensors differ in shape")
            pair.append(torch.stack(tensors))
        return pair[0], pair[1]


def wrap(model: nn.Module, context: grouped.PassContext, splits: dict[str, grouped.Split]
         ) -> dict[str, ExpertPart]:
    """Every MoE experts module of the model switched to the LoRA implementation; returns its parts
    by path (`<experts path>.<projection>`)."""
    parts = {}
    for path, module in model.named_modules():
        if not (hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") and hasattr(module, "config")):
            continue
        if not getattr(module, "has_gate", True) or not (getattr(module, "is_concatenated", True)
                                                          or getattr(module, "is_transposed", False)):
            raise ValueError(f"{path}: experts without a gate, or with gate and up interleaved in [E, out, in] "
                             "weights, have no LoRA here")
        split = splits.get(path)
        mine = {proj: ExpertPart(module, proj, split) for proj in projections(module)}
        config: Any = module.config  # (transformers' config of the block)
        before: _Block | None = getattr(module, "_quilt_lora", None)  # (a gang's dispatch: `dispatch_tokens`)
        module._quilt_lora = _Block(mine, context, before.base if before else config._experts_implementation,
                                    split or (before.split if before else None))
        parts.update({f"{path}.{proj}": part for proj, part in mine.items()})
    if parts:
        _install(model)
    return parts


def dispatch_tokens(model: nn.Module) -> int:
    """Every experts module of an expert-parallel gang's base (its experts split over the ranks, its
    router choosing among all of them) run by this implementation, which sends each token to its
    expert's rank (`batcher.engine.dispatch`), with or without LoRA on the experts. Returns how many."""
    count = 0
    for module in model.modules():
        if hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") and hasattr(module, "config"):
            split = split_of(module)
            if split is not None:
                experts: Any = module  # (transformers' experts block)
                experts._quilt_lora = _Block({}, None, experts.config._experts_implementation, split)
                count += 1
    if count:
        _install(model)
    return count


def _install(model: nn.Module) -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, _experts_forward)
    for module in model.modules():
        if hasattr(module, "_quilt_lora"):
            config: Any = module.config
            config._experts_implementation = IMPLEMENTATION


def split_of(module: nn.Module) -> grouped.Split | None:
    """The expert-parallel share of an experts module (a gang's "ep": its tensor-parallel axis splits
    the experts), None where it holds all its experts when it runs (one process, FSDP); ValueError
    where that axis splits each expert's width ("tp")."""
    weight = module.down_proj
    names = weight.device_mesh.mesh_dim_names if isinstance(weight, DTensor) else None
    if not isinstance(weight, DTensor) or names is None or "tp" not in names:
        return None
    mesh = weight.device_mesh
    tp = names.index("tp")
    placement = weight.placements[tp]
    if mesh.size(tp) == 1 or placement.is_replicate():
        return None
    if not placement.is_shard(0):
        raise ValueError(f"a tensor-parallel gang splits each expert's width ({placement}); expert LoRA needs the "
                         "experts whole: an expert-parallel gang (--trainer-parallel ep) or one process")
    return grouped.Split("experts", mesh.get_local_rank(tp), mesh.size(tp), mesh.get_group(tp),
                           grouped.tp_mesh(mesh))


class _Block:
    """What a wrapped experts module reads in its forward: its LoRA parts (none on a gang's experts
    that carry no LoRA) and, in an expert-parallel gang, its share of the experts (`split`)."""

    def __init__(self, parts: dict[str, ExpertPart], context: grouped.PassContext | None, base: str | None,
                 split: grouped.Split | None):
        self.parts = parts
        self.context = context
        self.base = base or "eager"  # the implementation the base ran with
        self.split = split

    def classes(self) -> list[tuple[int, grouped.Route]]:
        """The pass's LoRA rank classes on these experts: (rank, its experts route)."""
        routes = (self.context.routes if self.context is not None else None) or {}
        gate = next(iter(self.parts.values()), None)
        if gate is None:
            return []
        return [(rank, route) for (kind, rank), route in routes.items() if kind == "experts" and rank in gate.slabs]


def _param(module: nn.Module, name: str) -> torch.Tensor:
    """A module's tensor attribute (a MoE block's fused experts weights)."""
    t = getattr(module, name)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.{name} is not a tensor")
    return t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _histogram(keys: torch.Tensor, count: int) -> torch.Tensor:
    """How many keys fall in each of 0..count-1 (keys past it are left out). histc, not bincount:
    bincount sizes its output from the keys' maximum, read on the host (a sync). (Integer keys on
    CUDA, float ones elsewhere.)"""
    keys = keys.int() if keys.is_cuda else keys.float()
    if count == 1:  # (histc given min == max takes the keys' own range, and would count keys past it: one
        return (keys == 0).sum().reshape(1).to(keys.dtype)  # expert a rank with one member, a gang's rank)
    return torch.histc(keys, bins=count, min=0, max=count - 1)


class _Groups:
    """Rows in group order and the offsets of each group's end: the grouped GEMM's input. `order`
    sorts rows into it (None: they are in it already). Rows past the last group (the
    expert-parallel sentinel, where `partial`) come out 0."""

    def __init__(self, sizes: torch.Tensor, *, order: torch.Tensor | None = None, partial: bool):
        self.sizes = sizes
        self.offsets = torch.cumsum(sizes, 0).to(torch.int32)
        self.order = order
        self.partial = partial

    @classmethod
    def by_key(cls, keys: torch.Tensor, count: int, *, partial: bool) -> _Groups:
        """Rows sorted (stably) by a key in 0..count-1; keys >= count sort last, in no group."""
        return cls(_histogram(keys, count), order=torch.argsort(keys, stable=True), partial=partial)

    def take(self, rows: torch.Tensor) -> torch.Tensor:
        return rows if self.order is None else rows.index_select(0, self.order)

    def put(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows in group order back in their original order."""
        return rows if self.order is None else rows.new_empty(rows.shape).index_copy(0, self.order, rows)

    def mm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """`x[rows of g] @ weight[g].T` for every group g, on rows in group order."""
        if grouped.groupable(x, weight.shape[1], weight.shape[2], x.shape[0]):
            if not self.partial:
                return grouped.grouped_mm(x, weight.transpose(1, 2), offs=self.offsets)
            # The kernel leaves rows past the last group unwritten, in its output and in the input's
            # gradient: both are masked (masked_fill's backward zeroes the masked rows' gradient).
            past = torch.arange(x.shape[0], device=x.device).unsqueeze(1) >= self.offsets[-1]
            return grouped.grouped_mm(x.masked_fill(past, 0), weight.transpose(1, 2), offs=self.offsets
                                    ).masked_fill(past, 0)
        # float64 (tests), or widths the kernel cannot take: one matmul per group that has rows
        sizes = [int(n) for n in self.sizes.tolist()]
        live = [g for g, n in enumerate(sizes) if n]
        chosen = weight.index_select(0, torch.tensor(live, device=weight.device)) if live else weight[:0]
        pieces, start = [], 0
        for i, g in enumerate(live):
            pieces.append(x[start:start + sizes[g]] @ chosen[i].T)
            start += sizes[g]
        pieces.append(x.new_zeros((x.shape[0] - start, weight.shape[1])))
        return torch.cat(pieces)


class _Leaf:
    """The rows of a slab's compute copy that a pass uses, as an autograd leaf: its gradient is
    added into those rows of the slab's gA / gB once whole, then dropped (the slabs, not autograd,
    hold gradients)."""

    @staticmethod
    def of(slab: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        taken = slab.index_select(0, rows)
        if not torch.is_grad_enabled():
            return taken
        leaf = taken.requires_grad_()

        def into_slab(p: torch.Tensor) -> None:
            if p.grad is not None:
                grads.index_add_(0, rows, p.grad.to(grads.dtype))
            p.grad = None

        leaf.register_post_accumulate_grad_hook(into_slab)
        return leaf


def _class_factors(block: _Block, i: int, rank: int, route: grouped.Route, pairs: _Groups, member: torch.Tensor,
                   expert: torch.Tensor, experts: int) -> tuple[_Groups, dict[str, tuple[torch.Tensor, torch.Tensor, float]]]:
    """One rank class's grouping of the sorted rows and its three parts' (A, B, scale): the first
    class groups as the rows were sorted, (expert, adapter) with a zero row for the others; a
    further class regroups the sorted rows by (its adapter, expert). `member`: each row's index
    among the class's members (their count: its adapter is not of the class)."""
    members, _ = route.members_on_device()
    factors = {}
    for proj, part in block.parts.items():
        slab = part.slabs[rank]
        A = _Leaf.of(slab.A_c, members, slab.gA)  # [members, E, r, in]
        B = _Leaf.of(slab.B_c, members, slab.gB)
        if i == 0:  # expert-major with a zero row for the others: [E * (members + 1), r, in]
            A, B = (torch.cat([t, t.new_zeros((1, *t.shape[1:]))]).transpose(0, 1).flatten(0, 1) for t in (A, B))
        else:
            A, B = A.flatten(0, 1), B.flatten(0, 1)  # [members * E, r, in]
        factors[proj] = (A, B, slab.scale)
    if i == 0:
        return _Groups(pairs.sizes, partial=False), factors
    n = members.shape[0]
    m = pairs.take(member)
    k = (m * experts + pairs.take(expert)).masked_fill(m == n, n * experts)
    return _Groups.by_key(k, n * experts, partial=True), factors


def _experts_forward(module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """The "quilt_lora" experts implementation (see the module's docstring): in one process each
    (token, chosen expert) pair's rows here; in an expert-parallel gang each pair of this rank's share
    of the tokens on the rank of its expert (`batcher.engine.dispatch`), its adapter's member index of
    each rank class travelling with it."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    experts_module: Any = module  # transformers' experts block: its weights and gate are its own attributes
    block: _Block = experts_module._quilt_lora
    classes = block.classes()
    tokens, top_k = top_k_index.shape
    for _, route in classes:
        if route.runs[-1][2] != tokens:
            raise RuntimeError(f"experts route covers {route.runs[-1][2]} tokens, the block has {tokens}")
    tags = (torch.stack([route.member_of_token for _, route in classes], dim=1) if classes
            else torch.zeros((tokens, 0), dtype=torch.long, device=hidden.device))
    if block.split is not None:
        split = block.split
        return dispatch.run(hidden, top_k_index, top_k_weights, tags,
                            lambda x, expert, tags: _expert_rows(experts_module, block, classes, x, expert, tags),
                            rank=split.index, ranks=split.count, experts_per_rank=_local(experts_module.down_proj).shape[0],
                            group=split.group)
    if not classes:
        base = ALL_EXPERTS_FUNCTIONS.get_interface(block.base, cast(Any, type(module).forward).__wrapped__)
        out: torch.Tensor = base(module, hidden, top_k_index, top_k_weights)
        return out
    token = torch.arange(tokens, device=hidden.device).repeat_interleave(top_k)
    out = _expert_rows(experts_module, block, classes, hidden.index_select(0, token), top_k_index.reshape(-1),
                       tags.index_select(0, token))
    out = out * top_k_weights.reshape(-1, 1).to(out.dtype)
    return out.view(tokens, top_k, -1).sum(dim=1).to(hidden.dtype)


def _expert_rows(module: Any, block: _Block, classes: list[tuple[int, grouped.Route]], x: torch.Tensor,
                 expert: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
    """Each row of `x` through its expert (`expert`: an index among this rank's) with the LoRA of its
    adapter (`tags[:, i]`: its member index in rank class i), in the rows' order.

    The rows are sorted once, by (expert, adapter of the first rank class): each expert's rows are
    contiguous for the base's grouped GEMM, and each (expert, adapter) group's for that class's LoRA,
    on the same rows. Adapters of the pass not on the experts, and rows of other classes, form each
    expert's last group, whose LoRA weights are zero."""
    experts = _local(module.down_proj).shape[0]
    slots = classes[0][1].members_on_device()[0].shape[0] + 1 if classes else 1
    key = expert * slots + (tags[:, 0] if classes else 0)
    pairs = _Groups.by_key(key, experts * slots, partial=False)
    by_expert = _Groups(_histogram(expert, experts), partial=False)
    xs = pairs.take(x)
    lora = [_class_factors(block, i, rank, route, pairs, tags[:, i], expert, experts)
            for i, (rank, route) in enumerate(classes)]

    def delta(groups: _Groups, rows: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float) -> torch.Tensor:
        return groups.put(groups.mm(groups.mm(groups.take(rows.to(A.dtype)), A) * scale, B))

    w_gate_up, w_down = _local(module.gate_up_proj), _local(module.down_proj)
    if getattr(module, "is_transposed", False):  # [E, in, out]: the grouped product takes [E, out, in]
        w_gate_up, w_down = w_gate_up.transpose(1, 2), w_down.transpose(1, 2)
    bias = _biases(module, pairs.take(expert))
    gate_up = by_expert.mm(xs, w_gate_up)
    if bias:
        gate_up = gate_up + bias[0]
    for groups, f in lora:
        gate_up = gate_up + (delta(groups, xs, *f["gate_up_proj"]) if "gate_up_proj" in f else torch.cat(
            [delta(groups, xs, *f["gate_proj"]), delta(groups, xs, *f["up_proj"])], dim=-1)).to(gate_up.dtype)
    mid = module._apply_gate(gate_up)
    out = by_expert.mm(mid, w_down)
    if bias:
        out = out + bias[1]
    for groups, f in lora:
        out = out + delta(groups, mid, *f["down_proj"]).to(out.dtype)
    return pairs.put(out)


def route_in_float64(model: nn.Module) -> int:
    """Switch DeepSeek-V3's routers (those with a score-correction bias) to score in float64; returns
    how many. transformers scores in float32 whatever the base's dtype (right for a bfloat16 base),
    but a float32 GEMM's rows vary with the batch's shape (the CPU picks other kernels), so on a
    float64 base (the tests') a token's routing weights would depend by ~1e-7 on what else shares its
    pass; in float64 they do not. Other dtypes keep transformers' float32 routing."""
    count = 0
    for module in model.modules():
        if hasattr(module, "e_score_correction_bias") and hasattr(module, "routed_scaling_factor"):
            module.forward = _float64_route.__get__(module)
            count += 1
    return count


def _float64_route(router: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' DeepseekV3TopkRouter.forward, in float64: sigmoid scores, the biased choice
    within the best groups, the unbiased weights of the chosen (normalised, scaled)."""
    x = hidden_states.view(-1, router.hidden_dim).double()
    logits = torch.nn.functional.linear(x, router.weight.double())
    scores = logits.sigmoid()
    choice = scores + router.e_score_correction_bias.double()
    groups = choice.view(-1, router.num_group, router.num_experts // router.num_group)
    group_idx = groups.topk(2, dim=-1)[0].sum(dim=-1).topk(router.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros(groups.shape[:2], dtype=choice.dtype, device=choice.device).scatter_(1, group_idx, 1)
    keep = group_mask.unsqueeze(-1).expand_as(groups).reshape(-1, router.num_experts).bool()
    index = choice.masked_fill(~keep, float("-inf")).topk(router.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, index)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, weights * router.routed_scaling_factor, index


def _biases(module: nn.Module, expert: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The gate_up and down biases of each sorted row's expert (none where the experts have none)."""
    if not getattr(module, "has_bias", False):
        return ()
    return tuple(_local(_param(module, name)).index_select(0, expert) for name in ("gate_up_proj_bias", "down_proj_bias"))
