"""Quilt's own fused pass at real shapes with no GPU and no weights: forward, backward and optimizer
step of N tenants x T tokens on PyTorch's meta device, watched operator by operator.

The pass is the trainer's (`batcher.engine.backend.LoraBackend`: the host plan of `batcher.engine.plan`,
the device half of `batcher.engine.device_pass`, the steps of `batcher.engine.optimizers`) on a base
built from its published config (no download: the configs are written here) on the meta device,
where every tensor has a shape, a dtype and strides but no storage. For each shape, on one rank:

  host syncs       operators inside the pass that read the device from the host (`.item()`,
                   `nonzero`, `aten._local_scalar_dense`, a device-to-host copy): want 0
  misplaced        operators mixing host and device tensors (0-dim host scalars aside), and float
                   conversions made by the engine's layer code (`batcher.engine.multilora`,
                   `expert_lora`, `grouped` outside gradient accumulation) that the plan did not ask
                   for: on a bfloat16 GPU base the adapters compute in bfloat16, so the only
                   conversions are the compute copies' refresh, gradients into the float32 masters,
                   the head's float32 log-softmax, the loss and the values read back (and the
                   model's own norms and rotary, which are transformers' and counted apart)
  misaligned       grouped-GEMM operands whose start or strides break 16 bytes (the kernel's rule)
  FLOPs            per pass (torch.utils.flop_counter, grouped GEMM taught to it), and the seconds
                   they take at 35% and 45% of the bf16 dense peak (989 TFLOP/s on an H100 SXM and
                   an H200, which have the same compute)
  operators        dispatched per pass eagerly, and in the bucketed step a CUDA graph would capture
                   (`batcher.engine.graphs`; a gang or expert LoRA runs eagerly, so the same)
  peak bytes       per rank: the high-water mark of the device storages operators made and that
                   are still alive (each counted once, freed by a weakref finalizer; torch's
                   mem_tracker runs on meta too but hooks every parameter, which a frozen base's
                   refuse) over a steady-state round (AdamW moments made, then a pass and a step),
                   plus the rank's base weights, beside what the memory plan (`bases.memory_plan`,
                   `quilt models plan`) says for the same tokens and tenants

Where the CUDA-only branches cannot run, the meta device stands in for a Hopper GPU and takes their
shapes (`gpu_like`): the adapters compute in the base's bfloat16 (`grouped.compute_dtype`), grouped
GEMM serves every slab whose strides allow it (`torch._grouped_mm` has a meta kernel: the same call
and operands as on the GPU), the packed rows' attention is the varlen kernel
(`torch.nn.attention.varlen.varlen_attn`, which has a meta kernel; its FLOPs are counted as full
squares per row, not halved for causality: the times are given both ways). AdamW is torch's
for-loop form (its fused kernel refuses the meta device; on a GPU one fused call per set of
hyperparameters takes the step). CUDA graphs are emulated (`Graphs(emulate=True)`): the captured step
is the bucketed step, run once.

Gangs are one rank's shard (rank 0), shaped as `batcher.engine.gang` shards the base:
  tp    heads, KV heads and MLP widths / R; every targeted Linear keeps its whole sizes and its LoRA
        splits as `gang.splits` splits it (column: B's rows; row: A's columns) over a fake process
        group (`torch.testing._internal.distributed.fake_pg`), so the LoRA's all-reduces are
        dispatched; the base's own collectives (its DTensors') are not
  ep    attention whole on every rank (every token, every head), E / R whole experts per rank, each
        token routed to max(1, k / R) of them: the (token, expert) pairs an even token dispatch
        (`batcher.engine.dispatch`) brings each rank; the all-to-alls themselves (and their send and
        receive buffers) are not dispatched, since the meta device cannot read their counts
  fsdp  data parallel (`batcher.engine.data_parallel`): rank 0 computes its share of the pass's
        rows, about 1/R of the tokens at every width, so its activations are the pass's / R; its
        weights are counted as FSDP holds them: the decoder's / R plus two layers gathered (the one
        running and the one prefetched), the unembedding whole; the all-gathers and the gradients'
        all-reduce are not dispatched
The base's weights are counted from the shard's own parameters (`tp`/`ep`: the unembedding's vocabulary
split / R as its "colwise_gather_output" plan splits it).

    python bench/gpu_dryrun.py --shapes 8b,70b-tp8,70b-fsdp8,235b-ep8,32b-128k --tenants 8 --tokens 64
    python bench/gpu_dryrun.py --shapes tiny --tenants 2 --tokens 16       (seconds; the fast test's)

Ends with one JSON line: per shape host_syncs, misplaced, misaligned, flops_per_pass,
tracked_peak_gib_per_rank, plan_peak_gib_per_rank and the rest of what it printed.
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import argparse
import contextlib
import dataclasses
import json
import sys
import tempfile
import time
import weakref
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula
from torch.utils.weak import WeakIdKeyDictionary

from bases import memory_plan
from batcher.engine import gang, grouped, multilora, packed_attention
from batcher.engine.backend import LoraBackend
from batcher.engine.protocol import PassRequest
from core.loss_spec import LossConfig
from core.settings import TrainerSettings
from core.work import AdamParams, Datum, LoraShape, PassWork

GiB = 2**30
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}  # SXM, bf16 dense, spec sheet (the H200 has the H100's compute)
PLAN_GPU_GB = {"tiny": 80, "tiny-moe": 80, "8b": 80, "70b": 80, "235b": 141, "32b": 80}  # the GPU each base is planned on (GiB,
# as `quilt models plan --gpu-memory 80GiB` takes it: an H100's 80 GB, an H200's 141 GB)

# Published shapes (config.json fields), not weights.
BASES: dict[str, dict[str, Any]] = {
    "tiny": {"model_type": "qwen3", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 768,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
             "max_position_embeddings": 4096, "tie_word_embeddings": False},
    "tiny-moe": {"model_type": "qwen3_moe", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 768,
                 "moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096,
                 "tie_word_embeddings": False},
    "8b": {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,  # Qwen3-8B
           "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
           "max_position_embeddings": 40960, "rope_theta": 1000000, "tie_word_embeddings": False},
    "32b": {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 5120, "intermediate_size": 25600,  # Qwen3-32B
            "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
            "max_position_embeddings": 131072, "rope_theta": 1000000, "tie_word_embeddings": False},
    "70b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,  # Llama-3.3-70B
            "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
            "max_position_embeddings": 131072, "rope_theta": 500000, "tie_word_embeddings": False},
    "235b": {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 4096,  # Qwen3-235B-A22B
             "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94,
             "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
             "num_experts_per_tok": 8, "max_position_embeddings": 40960, "rope_theta": 1000000,
             "tie_word_embeddings": False},
}


@dataclasses.dataclass(frozen=True)
class Shape:
    base: str
    parallel: str | None = None  # tp, ep, fsdp
    ranks: int = 1
    row_tokens: int = 0  # one row of this many tokens (one tenant) instead of --tenants x --tokens


SHAPES = {
    "tiny": Shape("tiny"),
    "tiny-tp2": Shape("tiny", "tp", 2),
    "tiny-moe-ep2": Shape("tiny-moe", "ep", 2),
    "tiny-fsdp2": Shape("tiny", "fsdp", 2),
    "8b": Shape("8b"),
    "70b-tp8": Shape("70b", "tp", 8),
    "70b-fsdp8": Shape("70b", "fsdp", 8),
    "235b-ep8": Shape("235b", "ep", 8),
    "32b-128k": Shape("32b", row_tokens=131072),
    # one long row (docs/benchmarks/long_context.md: the GPUs 8B and 32B need at each context)
    "8b-32k": Shape("8b", row_tokens=32768),
    "8b-128k": Shape("8b", row_tokens=131072),
    "8b-256k": Shape("8b", row_tokens=262144),
    "32b-32k": Shape("32b", row_tokens=32768),
    "32b-256k": Shape("32b", row_tokens=262144),
    # ... on the gangs the plan gives them (GPUs of 80 GiB; 8b-256k-tp4 and 32b-128k-tp8 on 141)
    "8b-128k-tp2": Shape("8b", "tp", 2, row_tokens=131072),
    "8b-256k-tp4": Shape("8b", "tp", 4, row_tokens=262144),
    "32b-32k-tp2": Shape("32b", "tp", 2, row_tokens=32768),
    "32b-128k-tp8": Shape("32b", "tp", 8, row_tokens=131072),
}


# ---------------------------------------------------------------------- the meta device as a Hopper GPU


@register_flop_formula(torch.ops.aten._grouped_mm)
def _grouped_mm_flops(a_shape: Any, b_shape: Any, *args: Any, **kwargs: Any) -> int:
    """2 x rows x inner x columns over the groups, whichever operand carries them."""
    if len(a_shape) == 2 and len(b_shape) == 3:  # [M, K] x [G, K, N]: rows grouped
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:  # [M, Ktot] x [Ktot, N]: the inner dimension grouped
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    if len(a_shape) == 3 and len(b_shape) == 2:  # [G, M, K] x [K, Ntot]
        return 2 * a_shape[1] * a_shape[2] * b_shape[1]
    return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]


@contextlib.contextmanager
def gpu_like() -> Iterator[None]:
    """The engine's device checks answer for the meta device as for a Hopper GPU (see the docstring),
    for the duration; every replaced function is put back."""
    from transformers import AttentionInterface

    from batcher.engine.expert_lora import ExpertPart

    grouped_gemm, compute_dtype, attention = grouped.grouped_gemm, grouped.compute_dtype, packed_attention._attention

    def meta_grouped_gemm(dtype: torch.dtype, device: torch.device) -> bool:
        return grouped_gemm(dtype, torch.device("cpu") if device.type == "meta" else device)

    def meta_compute_dtype(base_dtype: torch.dtype, device: torch.device) -> torch.dtype:
        return base_dtype if device.type == "meta" and base_dtype == torch.bfloat16 else compute_dtype(base_dtype, device)

    def meta_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:
        rows = packed_attention._current
        if query.device.type == "meta" and rows is not None and rows.cu_seqlens is not None:
            return packed_attention._varlen_attention(query, key, value, rows, scaling), None
        return attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)

    def whole_A(self: Any, rank: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
        whole = list(self.shapes(rank)[0])  # no values to draw: this rank's shape, whole along a split axis
        axis = self.split.axis("A") if self.split is not None else None
        if axis is not None:
            whole[axis] *= self.split.count
        return torch.empty(whole, dtype=dtype, device="meta")

    patches: list[tuple[Any, str, Any]] = [
        (grouped, "grouped_gemm", meta_grouped_gemm), (multilora, "compute_dtype", meta_compute_dtype),
        (multilora.MultiLoraLinear, "whole_A", whole_A), (ExpertPart, "whole_A", whole_A)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    packed_attention.register()
    AttentionInterface.register(packed_attention.NAME, meta_attention)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        AttentionInterface.register(packed_attention.NAME, attention)


# ---------------------------------------------------------------------- watching the operators


_SYNCS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "nonzero_static", "masked_select", "unique",
          "_unique", "_unique2", "unique_consecutive", "unique_dim", "bincount", "equal", "allclose"}
# Engine functions whose float conversions the plan asks for (module stem, function).
_ASKED = {("multilora", "refresh"), ("grouped", "accumulate"), ("expert_lora", "into_slab")}
_LAYER_CODE = {"multilora", "expert_lora", "grouped"}


class Watch(TorchDispatchMode):
    """Counts, per operator: host syncs (and serves a device-to-host read of a meta tensor with ones,
    so the host code after it goes on), operators mixing devices, float conversions by where they
    were asked, grouped-GEMM operands off 16 bytes, and every operator dispatched."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.storages: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.live = 0  # bytes of the device storages made under the mode and still alive
        self.peak = 0  # their high-water mark since made (or set)
        self.reset()

    def reset(self) -> None:
        self.ops: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self.mixed: Counter[str] = Counter()
        self.conversions: Counter[str] = Counter()
        self.unasked: Counter[str] = Counter()
        self.misaligned: Counter[str] = Counter()
        self.uploads = 0  # host-to-device copies (the plan's: one bundle per micro-batch)

    def _track(self, out: Any) -> None:
        """Count each new device storage an operator returns until it is freed (a view's is its base's)."""
        for t in _flat(out):
            if not isinstance(t, torch.Tensor) or t.device != self.device:
                continue
            storage = t.untyped_storage()
            if storage in self.storages:
                continue
            size = storage.nbytes()
            self.storages[storage] = size
            self.live += size
            weakref.finalize(storage, self._freed, size)
        self.peak = max(self.peak, self.live)

    def known(self, tensors: Any) -> None:
        """Storages made before the mode (the base's weights, counted apart): never counted when an
        operator returns a view of them."""
        for t in tensors:
            self.storages[t.untyped_storage()] = 0

    def _freed(self, size: int) -> None:
        self.live -= size

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        tensors = [t for t in _flat((args, kwargs)) if isinstance(t, torch.Tensor)]
        if name in _SYNCS and any(t.device == self.device for t in tensors):
            self.syncs[name] += 1
            return self._serve(func, args, kwargs)
        if name in ("_to_copy", "copy_"):
            read_back = self._transfer(name, args, kwargs)
            if read_back is not None:
                return read_back
        else:
            devices = {t.device.type for t in tensors if t.dim() > 0}
            if len(devices) > 1:
                self.mixed[name] += 1
                # counted; the host's operands moved over, so the run goes on to count the rest
                args, kwargs = tree_map_only(torch.Tensor, self._on_device, (args, kwargs))
        if name == "_grouped_mm":
            for t in tensors:
                if not _aligned(t):
                    self.misaligned[f"{tuple(t.shape)}:{t.stride()}+{t.storage_offset()}"] += 1
        out = func(*args, **kwargs)
        self._track(out)
        return out

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device) if t.device != self.device and t.dim() > 0 else t

    def _transfer(self, name: str, args: tuple[Any, ...], kwargs: Any) -> Any:
        """A copy: counts a read-back (served) or an upload, and a float conversion by its asker."""
        src = args[1] if name == "copy_" else args[0]
        dst_device = args[0].device if name == "copy_" else kwargs.get("device") or src.device
        dst_dtype = args[0].dtype if name == "copy_" else kwargs.get("dtype") or src.dtype
        if src.device == self.device and torch.device(dst_device).type == "cpu":
            self.syncs["device-to-host copy"] += 1
            if name == "copy_":
                return args[0].fill_(1)
            return torch.ones(src.shape, dtype=dst_dtype)
        if src.device.type == "cpu" and torch.device(dst_device) == self.device and src.dim() > 0:
            self.uploads += 1
        if src.dtype != dst_dtype and src.dtype.is_floating_point and dst_dtype.is_floating_point:
            where = _asker()
            key = f"{src.dtype}->{dst_dtype}".replace("torch.", "")
            self.conversions[f"{key} by {where[0] or 'the model/autograd'}"] += 1
            if where[0] in _LAYER_CODE and where not in _ASKED:
                self.unasked[f"{key} in {where[0]}.{where[1]}"] += 1
        return None

    def _serve(self, func: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        """A data-dependent operator on meta has no answer: a stand-in one, so the run goes on to count."""
        name = func.overloadpacket.__name__
        if name in ("_local_scalar_dense", "item", "is_nonzero", "equal", "allclose"):
            return True if name in ("is_nonzero", "equal", "allclose") else 1
        t = args[0]
        if name in ("nonzero", "nonzero_static"):
            return torch.zeros((t.numel(), t.dim()), dtype=torch.long, device=t.device)
        return t.flatten()


def _flat(tree: Any) -> list[Any]:
    from torch.utils._pytree import tree_leaves

    return tree_leaves(tree)


def _aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    if t.storage_offset() * size % 16:
        return False
    return all(s * size % 16 == 0 for s, n in zip(t.stride(), t.shape) if s != 1 and n > 1)


def _asker() -> tuple[str | None, str]:
    """Who asked for an operator: the innermost frame outside torch and this file, as (module stem,
    function) where it is the engine's (batcher/engine), (None, "") where it is the model's own code
    (transformers) or a built-in backward's (autograd running under the engine's call of .backward())."""
    frame = sys._getframe(2)
    while frame is not None and ("/torch/" in frame.f_code.co_filename
                                 or frame.f_code.co_filename.endswith("gpu_dryrun.py")):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None or "/batcher/engine/" not in frame.f_code.co_filename:
        return None, ""
    inner = Path(frame.f_code.co_filename).stem, frame.f_code.co_name
    if torch._C._current_autograd_node() is None:
        return inner
    while frame is not None and "/batcher/engine/" in frame.f_code.co_filename:
        if frame.f_code.co_name in ("backward", "into_slab"):  # an engine Function's backward, a slab hook
            return inner
        frame = frame.f_back  # type: ignore[assignment]
    return None, ""


# ---------------------------------------------------------------------- one rank's base


def shard_config(config: dict[str, Any], shape: Shape, ranks: int) -> dict[str, Any]:
    """The config of rank 0's share (tp: heads, KV heads and MLP widths / R; ep: the dense MLP's width
    / R, E / R experts and k / R of them per token, at least one)."""
    if shape.parallel not in ("tp", "ep") or ranks == 1:
        return dict(config)
    local = dict(config)
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size") if shape.parallel == "tp" \
            else ("intermediate_size",):
        local[key] = config[key] // ranks
    if shape.parallel == "ep":
        local["num_experts"] = config["num_experts"] // ranks
        local["num_experts_per_tok"] = max(1, config["num_experts_per_tok"] // ranks)
    return local


def build(config: dict[str, Any], dtype: torch.dtype) -> Any:
    """A transformers causal LM of this config on the meta device (no weights anywhere)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def tp_splits(model: Any, config: dict[str, Any], ranks: int) -> dict[str, grouped.Split]:
    """Rank 0's LoRA shares as `gang.splits` reads them off a tensor-parallel base: each Linear the
    plan splits gets its whole sizes back (what a DTensor weight reports) and its Split."""
    from transformers.distributed.tensor_parallel import replace_layer_number_by_wildcard

    plan = {f"model.{k}": v for k, v in (model.config.base_model_tp_plan or {}).items()}
    out = {}
    for path, module in model.named_modules():
        style = plan.get(replace_layer_number_by_wildcard(path))
        if not isinstance(module, torch.nn.Linear) or style not in ("colwise", "rowwise"):
            continue
        if style == "colwise":
            module.out_features *= ranks
        else:
            module.in_features *= ranks
        out[path] = grouped.Split("out" if style == "colwise" else "in", 0, ranks, dist.group.WORLD)
    return out


def base_bytes(model: Any, shape: Shape, ranks: int) -> int:
    """Rank 0's base weights as its gang holds them (see the docstring)."""
    head = model.get_output_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    head_bytes = head.numel() * head.element_size()
    if shape.parallel in ("tp", "ep") and ranks > 1:
        return total - head_bytes + head_bytes // ranks
    if shape.parallel == "fsdp" and ranks > 1:
        layers = model.get_decoder().layers
        layer = sum(p.numel() * p.element_size() for p in layers[0].parameters())
        return (total - head_bytes) // ranks + 2 * layer + head_bytes
    return total


@contextlib.contextmanager
def fake_gang(ranks: int) -> Iterator[None]:
    """A fake process group of `ranks` (this process rank 0): collectives dispatch and return at once."""
    if ranks == 1:
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------- the dry run


def requests(tenants: int, tokens: int, vocab: int) -> list[PassRequest]:
    out = []
    for i in range(tenants):
        toks = tuple((7 * i + j) % vocab for j in range(tokens + 1))
        datum = Datum(toks[:-1], {"target_tokens": toks[1:], "weights": (1.0,) * tokens})
        out.append(PassRequest(f"r{i}", f"t{i}", PassWork("cross_entropy", LossConfig(), (datum,)), False))
    return out


ADAM = AdamParams(learning_rate=1e-5, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0)


def round_of(be: LoraBackend, reqs: list[PassRequest]) -> None:
    """One fused pass's device half, then every tenant's optimizer step on the gradients it left."""
    be.planned_pass(reqs)()
    for r in reqs:
        be.lora.set_grads(be.adapters[r.model_id].name)
    be.optim_steps([(r.model_id, ADAM) for r in reqs])


def dry_run(name: str, *, tenants: int, tokens: int, rank: int, checkpoint_tokens: int) -> dict[str, Any]:
    """One shape's figures (see the module's docstring)."""
    shape = SHAPES[name]
    config = BASES[shape.base]
    if shape.row_tokens:
        tenants, tokens = 1, shape.row_tokens
    ranks, refused = shape.ranks, []
    while shape.parallel and ranks > 1 and (problems := gang.check_shape(gang.GangShape(ranks, shape.parallel),  # type: ignore[arg-type]
                                                                         config)):
        refused.append(f"{ranks} ranks: " + "; ".join(problems))
        ranks //= 2
    started = time.perf_counter()
    device = torch.device("meta")
    watch = Watch(device)
    with tempfile.TemporaryDirectory() as tmp, fake_gang(ranks), gpu_like():
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        model = build(shard_config(config, shape, ranks), torch.bfloat16)
        weights = base_bytes(model, shape, ranks)
        watch.known([*model.parameters(), *model.buffers()])
        member = None
        if ranks > 1:
            member = gang.Member(0, ranks, gang.GangShape(ranks, shape.parallel), None)  # type: ignore[arg-type]
        splits = tp_splits(model, config, ranks) if shape.parallel == "tp" and ranks > 1 else {}
        saved_splits = gang.splits

        def rank_splits(model: torch.nn.Module, targets: tuple[str, ...]) -> dict[str, grouped.Split]:
            return splits  # rank 0's shares, made above off the shard's sizes

        gang.splits = rank_splits
        try:
            with watch:
                be = LoraBackend(tmp, device="meta", dtype=torch.bfloat16, max_tokens_per_pass=tenants * tokens,
                                 pack_width=max(4096, tokens), model=model, member=member, max_resident=tenants,
                                 emulate_graphs=True, checkpoint_tokens=checkpoint_tokens)
                # the GPU's planning: 16-byte token alignment, the head's chunks at it, varlen asked
                be.planner.align = 8
                be.planner.head_chunk_tokens = _chunk_tokens(config, 8)
                be.planner.device_type = "cuda"
                for i in range(tenants):
                    be.create(f"t{i}", LoraShape(rank=rank, seed=i))
                stages = {"adapters": watch.live}
                reqs = requests(tenants, tokens, config["vocab_size"])
                be.planner.cuda_graphs = False
                round_of(be, reqs)  # the first steps make the AdamW moments: the next round is the steady state
                stages["adapters and AdamW"] = watch.live
                watch.reset()
                watch.peak = watch.live  # the peak from here: the steady state's round
                flops = FlopCounterMode(display=False)
                with flops:
                    be.planned_pass(reqs)()
                pass_watch = _figures(watch)
                # The peak from a pass of its own: FlopCounterMode's module tracker keeps a checkpointed
                # layer's replayed activations (batcher.engine.recompute) until the backward ends.
                for r in reqs:
                    be.lora.clear_grads(be.adapters[r.model_id].name)
                watch.peak = watch.live
                be.planned_pass(reqs)()
                stages["pass peak"] = watch.peak
                watch.reset()
                for r in reqs:
                    be.lora.set_grads(be.adapters[r.model_id].name)
                be.optim_steps([(r.model_id, ADAM) for r in reqs])
                step_watch = _figures(watch)
                peak = stages["round's peak"] = watch.peak
                captured = _captured(be, reqs, watch)
        finally:
            gang.splits = saved_splits
    plan = _plan(config, shape, ranks, tenants, tokens, rank, checkpoint_tokens)
    total_flops = flops.get_total_flops()
    # the varlen kernel's FLOPs as the counter counts them: every row a full square (causal rows need half)
    attention = sum(v for op, v in flops.get_flop_counts()["Global"].items() if "varlen" in str(op))
    return {
        "base": shape.base, "parallel": shape.parallel, "ranks": ranks, "refused": refused, "tenants": tenants,
        "tokens": tokens, "rank": rank, "seconds": round(time.perf_counter() - started, 1),
        # over both passes, eager and bucketed (where the single device's captured routes take grouped GEMM)
        "host_syncs": sum(pass_watch["syncs"].values()) + sum(captured["syncs"].values()),
        "misplaced": pass_watch["misplaced"] + captured["misplaced"],
        "misaligned": pass_watch["misaligned"] + captured["misaligned"],
        "grouped_gemm_calls": {"eager": pass_watch["grouped"], "bucketed": captured["grouped"]},
        "flops_per_pass": total_flops, "attention_flops": attention,
        "ms_at": {f"{gpu}@{int(mfu * 100)}%": round(total_flops / (tflops * 1e12 * mfu) * 1e3, 3)
                  for gpu, tflops in PEAK_TFLOPS.items() for mfu in (0.35, 0.45)},
        "ms_at_causal": {f"{gpu}@{int(mfu * 100)}%": round((total_flops - attention / 2) / (tflops * 1e12 * mfu) * 1e3, 3)
                         for gpu, tflops in PEAK_TFLOPS.items() for mfu in (0.35, 0.45)},
        "ops_eager": pass_watch["ops"], "ops_captured": captured["ops"], "captured": captured["how"],
        "uploads": pass_watch["uploads"], "conversions": pass_watch["conversions"],
        "sync_ops": {**pass_watch["syncs"], **captured["syncs"]},
        "misplaced_ops": {**pass_watch["misplaced_ops"], **captured["misplaced_ops"]},
        "step": {k: step_watch[k] for k in ("ops", "syncs", "misplaced")},
        "base_gib_per_rank": round(weights / GiB, 2),
        "tracked_gib": {k: round(v / GiB, 2) for k, v in stages.items()},
        "tracked_peak_gib_per_rank": round((weights + peak) / GiB, 2),
        **plan,
    }


def _chunk_tokens(config: dict[str, Any], align: int) -> int:
    from batcher.engine import head

    return head.chunk_tokens_for(config["vocab_size"], align=align)


def _figures(watch: Watch) -> dict[str, Any]:
    return {"ops": sum(watch.ops.values()), "syncs": dict(watch.syncs),
            "misplaced": sum(watch.mixed.values()) + sum(watch.unasked.values()),
            "misplaced_ops": {**watch.mixed, **watch.unasked}, "misaligned": sum(watch.misaligned.values()),
            "conversions": dict(watch.conversions), "uploads": watch.uploads,
            "grouped": watch.ops["_grouped_mm"]}


def _captured(be: LoraBackend, reqs: list[PassRequest], watch: Watch) -> dict[str, Any]:
    """The operators of the bucketed step a CUDA graph would capture (its first run, emulated), or why
    the planner runs the pass eagerly."""
    for r in reqs:
        be.lora.clear_grads(be.adapters[r.model_id].name)
    be.planner.cuda_graphs = True
    watch.reset()
    be.planned_pass(reqs)()
    figures = _figures(watch)
    if be.planner.refused:
        return {**figures, "ops": None, "how": f"eager: {be.planner.refused}"}
    return {**figures, "how": f"captured ({dict(be.graphs.counts)})"}


def _plan(config: dict[str, Any], shape: Shape, ranks: int, tenants: int, tokens: int, rank: int,
          checkpoint_tokens: int) -> dict[str, Any]:
    """What the memory plan says for the same tokens, tenants and rank (the trainer on GPUs of its own)."""
    gib = PLAN_GPU_GB[shape.base]
    inputs = memory_plan.PlanInputs(device_bytes=gib * GiB, dtype="bfloat16", shared_device=False,
                                    token_budget=tenants * tokens, resident_adapters=tenants, adapter_rank=rank,
                                    trainer_ranks=ranks, trainer_parallel=shape.parallel or "tp",
                                    checkpoint_tokens=checkpoint_tokens)
    plan = memory_plan.plan_memory(config, inputs)
    peak = plan.trainer_bytes - plan.trainer_free_bytes  # base, slabs' zero row, activations, adapters
    trainer, _ = memory_plan.fewest_ranks(config, dataclasses.replace(inputs, token_budget=None, resident_adapters=None,
                                                                       trainer_ranks=1))
    out = {"plan_peak_gib_per_rank": round(peak / GiB, 2), "plan_gpu_gb": gib,
           "plan_trainer_gpus": trainer, "plan_fits": not plan.trainer_problems}
    if shape.row_tokens:  # a long row: the fewest GPUs of each size that train it (None: no gang does)
        out["plan_context_gpus"] = {f"{gb}GiB": memory_plan.context_gpus(config, shape.row_tokens, dataclasses.replace(
            inputs, device_bytes=gb * GiB, token_budget=None, resident_adapters=None, trainer_ranks=1)) for gb in (80, 141)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="tiny", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per tenant (one datum each)")
    parser.add_argument("--rank", type=int, default=32, help="every tenant's LoRA rank (Tinker's default)")
    parser.add_argument("--checkpoint-tokens", type=int, default=TrainerSettings.model_fields["checkpoint_tokens"].default,
                        help="micro-batches of this many tokens checkpoint each decoder layer (the trainer's "
                             "QUILT_TRAINER_CHECKPOINT_TOKENS; 0: never)")
    args = parser.parse_args()
    names = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    print(f"torch {torch.__version__} on meta; the GPU path's stand-ins: bf16 compute, grouped GEMM, varlen attention, "
          "emulated CUDA graphs (see the docstring)\n")
    results = {}
    for name in names:
        r = results[name] = dry_run(name, tenants=args.tenants, tokens=args.tokens, rank=args.rank,
                                    checkpoint_tokens=args.checkpoint_tokens)
        report(name, r)
    print(json.dumps({"shapes": results}))


def report(name: str, r: dict[str, Any]) -> None:
    gang_text = f"{r['parallel']} gang of {r['ranks']}, rank 0" if r["ranks"] > 1 else "one device"
    print(f"=== {name}: {r['base']}, {gang_text}; {r['tenants']} tenants x {r['tokens']:,} tokens, LoRA rank "
          f"{r['rank']} ({r['seconds']} s on meta)")
    for why in r["refused"]:
        print(f"  refused by gang.check_shape at {why}")
    print(f"  host syncs in the pass {r['host_syncs']} {r['sync_ops'] or ''}; misplaced {r['misplaced']} "
          f"{r['misplaced_ops'] or ''}; misaligned grouped-GEMM operands {r['misaligned']} (grouped GEMM calls, eager "
          f"{r['grouped_gemm_calls']['eager']}, bucketed {r['grouped_gemm_calls']['bucketed']}); uploads {r['uploads']}")
    print(f"  float conversions in the pass: {r['conversions']}")
    print(f"  FLOPs per pass {r['flops_per_pass']:.4g} (attention {r['attention_flops']:.3g}, full squares): "
          + ", ".join(f"{k} {v:,.4g} ms" for k, v in r["ms_at"].items()))
    print("  with causal attention's half: " + ", ".join(f"{k} {v:,.4g} ms" for k, v in r["ms_at_causal"].items()))
    print(f"  operators per pass: eager {r['ops_eager']:,}; bucketed (what a graph captures) "
          f"{r['ops_captured'] if r['ops_captured'] is not None else '-'} [{r['captured']}]")
    print(f"  optimizer step: {r['step']['ops']:,} operators, read-backs {r['step']['syncs']}, misplaced "
          f"{r['step']['misplaced']}")
    print(f"  tracked beside the base, GiB: {r['tracked_gib']}")
    print(f"  peak per rank: tracked {r['tracked_peak_gib_per_rank']:,.2f} GiB (base {r['base_gib_per_rank']:,.2f}); "
          f"plan {r['plan_peak_gib_per_rank']:,.2f} GiB; planned on {r['plan_gpu_gb']} GiB GPUs, the trainer needs "
          f"{r['plan_trainer_gpus'] or 'more than any gang its heads allow'}"
          + ("" if r["plan_fits"] else f"; these tenants at this rank do not fit {r['ranks']} of them"))
    if "plan_context_gpus" in r:
        print("  this row, GPUs the plan gives it: " + ", ".join(f"{size} {n or 'no gang'}"
                                                            for size, n in r["plan_context_gpus"].items()))
    print()


if __name__ == "__main__":
    main()
