"""What fits on a device: a pure estimate of a base's trainer and sampler memory, from its
config.json and the settings, before anything is loaded.

    plan = plan_memory(config, PlanInputs(device_bytes=80 * GiB, ...))
    plan.check()          # InvalidInput naming the setting to change, when it cannot fit

Both workers of a base share one device when they run on one: the generation worker (vLLM) takes
`gen_memory_share` of it, the trainer the rest. Estimates, not measurements: they count weights,
the KV cache, LoRA slots, per-adapter weights + gradients + AdamW moments (float32), and the
trainer's activations at its token budget (what a frozen-base LoRA backward keeps per token per
layer, or, where a pass of the budget checkpoints its layers, each layer's input and one layer's
replay; the head's input and one chunk of its float32 logits), with a fixed reserve for the
framework. Where a setting is left unset (resident adapters, token budget) it is derived from what
is left.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from bases import architectures
from core.errors import InvalidInput

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SINK_BYTES_PER_HEAD = 2 * 4  # float32 log-sum-exp and gate per token, head and sink layer
ADAPTER_STATE_COPIES = 4  # weights, gradients, AdamW exp_avg and exp_avg_sq, all float32
# ... and on a half-precision base one more copy of the weights in that dtype, which the slabs
# compute with (batcher.engine.multilora).
RESERVE_FRACTION = 0.08  # CUDA context, allocator fragmentation, workspace
MAX_RESIDENT_ADAPTERS = 256
MIN_TOKEN_BUDGET = 512
# The trainer's head computes a chunk of tokens' float32 logits at a time (batcher.engine.head), each
# chunk's within this many bytes.
HEAD_CHUNK_BYTES = 1 << 28


def resolve_dtype(dtype: str, device: str) -> str:
    """'auto' is bfloat16 on an accelerator and float32 on the CPU."""
    if dtype != "auto":
        return dtype
    return "float32" if device.startswith("cpu") else "bfloat16"


def parse_bytes(text: str) -> int:
    """'80GiB', '24 GB', '512MiB', '1e9' -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "tb": 10**12, "b": 1, "": 1}
    s = text.strip().lower().replace(" ", "")
    number = s.rstrip("kmgtib")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        raise InvalidInput(f"{text!r} is not a size like 80GiB", field="gpu_memory") from None
    if unit not in units or not 0 < value < 1e16:
        raise InvalidInput(f"{text!r} is not a size like 80GiB", field="gpu_memory")
    return int(value * units[unit])


@dataclass(frozen=True)
class PlanInputs:
    device_bytes: int  # memory of the device both workers use (or each uses, when not shared)
    dtype: str = "bfloat16"  # the base's resolved dtype
    shared_device: bool = True  # trainer and sampler on one device
    gen_memory_share: float = 0.5  # fraction of the device the sampler takes when shared
    token_budget: int | None = None  # trainer tokens per fused pass; None = derived
    resident_adapters: int | None = None  # adapters with state on the device; None = derived
    adapter_rank: int = 32  # rank resident adapters are planned at (Tinker's default); rank 64 counts twice
    max_lora_rank: int = 64  # vLLM reserves every LoRA slot at this rank
    max_loras: int = 8  # sampler adapter slots
    max_context: int = 8192  # the sampler's longest sequence
    trainer_ranks: int = 1  # GPUs of the trainer gang (tensor parallel: each holds 1/N of the layers)
    trainer_parallel: str = "tp"  # how a gang splits the base (batcher.engine.gang): tp, ep or fsdp
    sampler_ranks: int = 1  # vLLM's tensor-parallel size (each GPU holds 1/N of the weights and KV heads)
    expert_lora: bool = True  # MoE bases: adapters (and vLLM's LoRA slots) on every expert, split over the ranks
    # Captured passes (batcher.engine.graphs): the graphs' memory pool holds a pass's activations beside the
    # eager allocator's (a bucket's first pass runs eagerly), so a pass's tokens have two copies.
    cuda_graphs: bool = False
    # A training micro-batch of this many tokens checkpoints each decoder layer (batcher.engine.recompute,
    # QUILT_TRAINER_CHECKPOINT_TOKENS); 0: none does.
    checkpoint_tokens: int = 0


@dataclass(frozen=True)
class MemoryPlan:
    inputs: PlanInputs
    trainer_bytes: int
    base_bytes: int
    activation_bytes_per_token: int
    adapter_bytes: int  # one resident adapter at adapter_rank, all targets
    token_budget: int
    resident_adapters: int
    trainer_free_bytes: int  # after everything above (negative: does not fit)
    gen_bytes: int
    sampler_base_bytes: int  # the sampler's share of the weights (per GPU)
    lora_slot_bytes: int
    kv_bytes_per_token: int
    kv_cache_bytes: int
    kv_tokens: int
    max_sequences: int  # at max_context each
    # What does not fit, each "setting: why": the trainer's side and the sampler's side apart, since
    # each worker refuses only for its own.
    trainer_problems: tuple[str, ...]
    sampler_problems: tuple[str, ...]
    checkpointed: bool = False  # a pass of the token budget checkpoints its layers (activation_bytes_per_token is then theirs)

    @property
    def problems(self) -> tuple[str, ...]:
        return self.trainer_problems + self.sampler_problems

    @property
    def rank_tokens(self) -> int:
        """The tokens one rank computes per micro-batch: the budget, or its share in an FSDP gang."""
        return rank_tokens(self.token_budget, data_parallel_ways(self.inputs.trainer_ranks,
                                                                 self.inputs.trainer_parallel))

    def activation_bytes(self, tokens: int) -> int:
        """A pass's activations at `tokens` (as planned: checkpointed or not as the budget's pass is)."""
        return (self.activation_bytes_per_token * tokens + 3 * HEAD_CHUNK_BYTES) * (2 if self.inputs.cuda_graphs else 1)

    def check(self) -> None:
        if self.problems:
            raise InvalidInput("; ".join(self.problems), field=self.problems[0].split(":", 1)[0])

    def rows(self) -> list[tuple[str, str]]:
        def g(b: float) -> str:
            return f"{b / GiB:,.2f} GiB"

        return [
            ("trainer memory" + (f" per rank ({self.inputs.trainer_ranks} ranks)" if self.inputs.trainer_ranks > 1
                                 else ""), g(self.trainer_bytes)),
            ("  base weights", g(self.base_bytes)),
            ("  activations per token", f"{self.activation_bytes_per_token / 2**20:,.2f} MiB"
             + (" (layers checkpointed)" if self.checkpointed else "")),
            ("  token budget per pass", f"{self.token_budget:,}" + (f" ({self.rank_tokens:,} per rank)"
                                                                        if self.rank_tokens != self.token_budget else "")),
            ("  activations at the budget", g(self.activation_bytes(self.rank_tokens))),
            (f"  one rank-{self.inputs.adapter_rank} adapter (weights+grad+AdamW, fp32)",
             f"{self.adapter_bytes / 2**20:,.1f} MiB"),
            ("  resident adapters", f"{self.resident_adapters:,}"),
            ("  left over", g(self.trainer_free_bytes)),
            ("sampler memory" + (f" per GPU (tensor parallel {self.inputs.sampler_ranks})"
                                 if self.inputs.sampler_ranks > 1 else ""), g(self.gen_bytes)),
            ("  base weights", g(self.sampler_base_bytes)),
            ("  LoRA slots", g(self.lora_slot_bytes)),
            ("  KV cache", g(self.kv_cache_bytes)),
            ("  KV per token", f"{self.kv_bytes_per_token / 2**10:,.1f} KiB"),
            ("  tokens in the KV cache", f"{self.kv_tokens:,}"),
            (f"  sequences of {self.inputs.max_context:,} tokens", f"{self.max_sequences:,}"),
        ]

def plan_memory(config: Mapping, inputs: PlanInputs) -> MemoryPlan:
    shape = architectures.Shape.of(config)
    if shape.arch.linear_attention and inputs.cuda_graphs:
        # the trainer captures no graphs of a linear-attention base (its rows' recurrences follow host
        # spans a replay cannot: batcher.engine.backend), so its activations have one copy
        inputs = dataclasses.replace(inputs, cuda_graphs=False)
    h, layers, vocab = shape.hidden, shape.layers, shape.vocab
    width = DTYPE_BYTES[inputs.dtype]
    total, _active = architectures.parameter_counts(config)
    inter = shape.active_mlp_width

    problems: list[str] = []  # the trainer's
    sampler: list[str] = []
    if shape.arch.vision and inputs.trainer_ranks > 1:
        # a gang loads the causal LM alone, without the vision tower (batcher.engine.gang.check_shape)
        problems.append(f"trainer_ranks: {inputs.trainer_ranks} ranks cannot split a vision base; it trains in one "
                        "process (trainer_ranks 1)")
    if inputs.shared_device and not 0 < inputs.gen_memory_share < 1:
        sampler.append(f"gen_memory_share: {inputs.gen_memory_share} must be between 0 and 1 on a shared device")
    usable = int(inputs.device_bytes * (1 - RESERVE_FRACTION))
    gen_bytes = int(usable * inputs.gen_memory_share) if inputs.shared_device else usable
    trainer_bytes = usable - gen_bytes if inputs.shared_device else usable
    base_bytes = _trainer_base_parameters(config, inputs.trainer_ranks, inputs.trainer_parallel) * width
    sampler_base = total * width // inputs.sampler_ranks

    # A frozen-base LoRA backward keeps, per token and layer, the inputs of every wrapped Linear and
    # of the norms and attention (about 10 hidden-wide and 3 MLP-wide vectors in the base dtype, the
    # norms keeping theirs in float32; the head- and MLP-wide ones split over a tensor-parallel gang's
    # ranks, not over FSDP's, whose ranks each compute every width); per-head query and key norms keep
    # the queries and keys in float32 too; the logits and their log-softmax are float32. (Measured on
    # the meta device by bench/gpu_dryrun.py, within 3% on Qwen3-32B and Llama-3.3-70B; 8 hidden-wide
    # vectors and no float32 queries and keys had planned a 131,072-token row 16% short.)
    # An expert-parallel gang keeps attention whole on every rank, and each rank computes the (token,
    # expert) pairs dispatched to its experts (batcher.engine.dispatch): k / R of them per token.
    split = inputs.trainer_ranks if inputs.trainer_parallel in ("tp", "ep") else 1
    attn_split = inputs.trainer_ranks if inputs.trainer_parallel == "tp" else 1
    split_width = 2 * shape.heads * shape.head_dim // attn_split + 3 * inter // split
    if shape.arch.qk_norm:
        split_width += 2 * (shape.heads + shape.kv_heads) * shape.head_dim // attn_split
    if shape.arch.moe and inputs.expert_lora:
        # LoRA on the experts keeps more per (token, expert) pair: about 2 hidden- and 2 expert-wide
        # vectors (measured on the tiny Qwen3-MoE, batcher.engine.expert_lora), each pair on one rank
        split_width += shape.experts_per_token * (2 * h + 2 * shape.intermediate) // split
    if shape.arch.moe and inputs.trainer_parallel == "ep" and inputs.trainer_ranks > 1:
        # the dispatch's hidden-wide rows per pair: sent, received, sent back and put back in order
        # (planned, not measured: the dry run's meta device cannot run the all-to-alls)
        split_width += shape.experts_per_token * 4 * h // split
    layer = (10 * h + split_width) * width
    if shape.arch.experts_3d:
        # gpt-oss's sinks (batcher.engine.packed_attention.SinkAttention): per token and head, the
        # kernel's float32 log-sum-exp and the float32 gate it scales the output by; no score matrix
        layer += SINK_BYTES_PER_HEAD * shape.heads // attn_split
    # The head computes a chunk of tokens at a time (batcher.engine.head): per token it keeps its input,
    # the final norm's float32 one and the gradient flowing back (about four float32 hidden-wide
    # vectors); one chunk's logits, their log-softmax and its gradient are live at once (`chunk_bytes`).
    head = 4 * h * 4
    chunk_bytes = 3 * HEAD_CHUNK_BYTES
    full = layers * layer + head
    # Checkpointed layers (batcher.engine.recompute) keep each layer's input, and in the backward one
    # layer's replay at a time. (The dry run measured 131,072 tokens on Qwen3-32B 3% above this, 16,384
    # on Qwen3-8B 4% below: docs/benchmarks/journals/gpu_dryrun.md.)
    checkpointed = layers * h * width + layer + head
    compute_copy = width if width < 4 else 0
    # A tensor-parallel gang splits each dense layer's LoRA as it splits the layer; an expert-parallel
    # one splits only the experts' (attention's is whole, as attention is); FSDP keeps every LoRA whole.
    adapter_parameters = _adapter_parameters(config, inputs.adapter_rank, inputs.expert_lora, inputs.trainer_ranks,
                                             attn_split)
    # A pass also holds, until its backward, a compute-dtype copy of each of its adapters' rows: the
    # slots its runs read, gathered for the batched or grouped GEMM (batcher.engine.multilora); the
    # experts' twice (the rows taken, and their expert-major concatenation: batcher.engine.expert_lora).
    # Planned per resident adapter, as if every one were in the pass (bench/gpu_dryrun.py measured it).
    expert_parameters = adapter_parameters - _adapter_parameters(config, inputs.adapter_rank, False,
                                                                 inputs.trainer_ranks, attn_split)
    adapter = adapter_parameters * (4 * ADAPTER_STATE_COPIES + compute_copy + width) + expert_parameters * width
    # The slabs' last row, always zero (padding and non-targeting adapters read it): weights,
    # gradients and compute copy, no optimizer state (batcher.engine.multilora).
    left = trainer_bytes - base_bytes - adapter_parameters * (4 * 2 + compute_copy)
    if left <= 0:
        problems.append(f"device: the trainer's share ({trainer_bytes / GiB:.1f} GiB) cannot hold the base weights "
                        f"({base_bytes / GiB:.1f} GiB in {inputs.dtype}); use a larger device, a smaller "
                        "gen_memory_share, or put the sampler on another device")
    copies = 2 if inputs.cuda_graphs else 1
    # An FSDP gang is data parallel (batcher.engine.data_parallel): each rank computes its share of a
    # pass's tokens, so its activations are the budget's / R; the other gangs compute every token on every rank.
    ways = data_parallel_ways(inputs.trainer_ranks, inputs.trainer_parallel)
    budget, recomputes = _token_budget(inputs, max(left, 0) // copies, full, checkpointed, chunk_bytes, ways)
    activation = checkpointed if recomputes else full
    act_bytes = (activation * rank_tokens(budget, ways) + chunk_bytes) * copies
    resident = inputs.resident_adapters
    if resident is None:
        resident = max(0, min(MAX_RESIDENT_ADAPTERS, int((left - act_bytes) // adapter)))
    free = left - act_bytes - resident * adapter
    if left > 0 and free < 0:
        problems.append(f"token_budget: {budget:,} tokens per pass ({act_bytes / GiB:.1f} GiB of activations) and "
                        f"{resident} resident adapters do not fit the trainer's {left / GiB:.1f} GiB after the "
                        "weights; lower QUILT_TRAINER_TOKEN_BUDGET or the resident adapters")
    elif left > 0 and resident < 1:
        problems.append("token_budget: no adapter fits beside the activations; lower QUILT_TRAINER_TOKEN_BUDGET")

    # vLLM splits the KV heads over its GPUs (past their count, each GPU keeps one head's copy; a
    # latent attention's one latent is on every GPU); only full-attention layers have a KV cache
    kv_per_token = (shape.attention_layers * shape.kv_width * width
                    // min(inputs.sampler_ranks, 1 if shape.latent else shape.kv_heads))
    lora_slots = inputs.max_loras * _adapter_parameters(config, inputs.max_lora_rank, inputs.expert_lora,
                                                        inputs.sampler_ranks) * width
    # vLLM's own activation peak at its batch: about one max_context prefill's worth
    gen_activation = inputs.max_context * (4 * h + 2 * inter // inputs.sampler_ranks) * width \
        + inputs.max_context * vocab * 4 // 16
    kv_cache = gen_bytes - sampler_base - lora_slots - gen_activation
    kv_tokens = max(0, kv_cache // kv_per_token)
    sequences = kv_tokens // max(1, inputs.max_context)
    if sequences < 1:
        sampler.append(f"gen_memory_share: the sampler's {gen_bytes / GiB:.1f} GiB leaves "
                        f"{max(kv_cache, 0) / GiB:.2f} GiB of KV cache after the weights and LoRA slots, less than "
                        f"one sequence of {inputs.max_context:,} tokens; raise gen_memory_share, lower max_loras or "
                        "max_context, or use a larger device")
    return MemoryPlan(inputs, trainer_bytes, base_bytes, activation, adapter, budget, resident, free, gen_bytes,
                      sampler_base, lora_slots, kv_per_token, max(kv_cache, 0), kv_tokens, sequences, tuple(problems),
                      tuple(sampler), recomputes)


def _token_budget(inputs: PlanInputs, left: int, full: int, checkpointed: int, chunk_bytes: int,
                  ways: int) -> tuple[int, bool]:
    """The token budget per pass (the configured one, or half of `left` to one rank's activations,
    the rest to adapters, times the `ways` a data-parallel gang splits it) and whether a pass of it
    checkpoints its layers (a rank's micro-batch of `inputs.checkpoint_tokens` or more does)."""
    def recomputes(tokens: int) -> bool:  # never in a data-parallel gang (batcher.engine.backend says why)
        return ways == 1 and 0 < inputs.checkpoint_tokens <= tokens

    if inputs.token_budget is not None:
        return inputs.token_budget, recomputes(rank_tokens(inputs.token_budget, ways))
    half = max(0, left * 0.5 - chunk_bytes)
    per_rank = max(MIN_TOKEN_BUDGET, min(65_536, int(half // full)))
    if inputs.checkpoint_tokens > 0:  # past the threshold a pass keeps less per token: a larger budget may fit
        more = min(65_536, int(half // checkpointed))
        if recomputes(more) and more > per_rank:
            per_rank = more
    return ways * per_rank, recomputes(per_rank)


def _adapter_parameters(config: Mapping, rank: int, expert_lora: bool, ranks: int, dense_split: int = 1) -> int:
    """One adapter's parameters on one GPU, on every module the base lets LoRA target: the experts'
    LoRA (MoE bases, unless left out) is split over the GPUs, which hold the experts apart (the
    trainer gang's expert parallel, vLLM's expert parallel); the rest is split `dense_split` ways as
    a tensor-parallel gang splits it (1: whole per GPU)."""
    targets = list(architectures.of_config(config).targets(tied=False))
    dense = [t for t in targets if t not in architectures.EXPERT_MODULES]
    plain = architectures.lora_parameters(config, rank, dense, dense_split)
    experts = architectures.lora_parameters(config, rank, targets, dense_split) - plain if expert_lora else 0
    return plain + experts // ranks


def _trainer_base_parameters(config: Mapping, ranks: int, parallel: str) -> int:
    """The base's parameters one rank of a trainer gang holds (batcher.engine.gang). Tensor and expert
    parallel: the decoder layers split over the ranks, the input embeddings whole on each (the plans
    do not split them), the unembedding split by vocabulary ("colwise_gather_output"; whole where it
    is tied to the embeddings). FSDP: the decoder, embeddings included, sharded over the ranks, plus
    two layers gathered whole (the one running and the one prefetched), the unembedding whole. Expert
    parallel: the routed experts split over the ranks, the rest whole (attention, routers, norms; a
    dense layer's MLP, which its plan splits, counted whole) but the unembedding, split as above."""
    total, _ = architectures.parameter_counts(config)
    if ranks == 1:
        return total
    shape = architectures.Shape.of(config)
    embed = shape.vocab * shape.hidden
    head = 0 if shape.tied else embed
    if parallel == "fsdp":
        layer = (total - embed - head) // shape.layers
        return (total - head) // ranks + 2 * layer + head
    if parallel == "ep":
        experts = architectures.routed_expert_parameters(config)
        return total - experts + experts // ranks - head + head // ranks
    return (total - embed - head) // ranks + embed + (head // ranks if head else 0)


RANK_CHOICES = (1, 2, 4, 8, 16, 32, 64)  # GPUs per node are powers of two; past 8 a gang spans nodes


def fewest_ranks(config: Mapping, inputs: PlanInputs) -> tuple[int | None, int | None]:
    """(trainer ranks, sampler tensor-parallel size): the fewest GPUs of `inputs.device_bytes` each
    on which the trainer gang and the sampler fit, planned on separate devices (a base this big
    gives each worker its own GPUs); None where even 64 do not. Heads must divide evenly over a
    tensor-parallel trainer gang (an expert-parallel one keeps attention whole: its experts must
    divide); vLLM also needs its attention heads divisible by its size."""
    shape = architectures.Shape.of(config)
    separate = dataclasses.replace(inputs, shared_device=False)

    def splits(n: int) -> bool:
        if inputs.trainer_parallel == "ep":
            return shape.experts % n == 0
        return shape.heads % n == 0 and shape.kv_heads % n == 0

    trainer = next((n for n in RANK_CHOICES if splits(n)
                    and not plan_memory(config, dataclasses.replace(separate, trainer_ranks=n)).trainer_problems),
                   None)
    sampler = next((n for n in RANK_CHOICES if shape.heads % n == 0
                    and not plan_memory(config, dataclasses.replace(separate, sampler_ranks=n)).sampler_problems),
                   None)
    return trainer, sampler


def device_bytes(device: str, configured: str = "") -> int:
    """Memory to plan with: the configured size, else the device's total (CUDA) or the host's
    available memory (CPU)."""
    if configured:
        return parse_bytes(configured)
    if device.startswith("cuda"):
        import torch

        index = torch.device(device).index or 0
        return torch.cuda.get_device_properties(index).total_memory
    import psutil

    return psutil.virtual_memory().available


def for_worker(config: Mapping, *, device: str, dtype: str, configured_memory: str = "", token_budget: int = 0,
               max_lora_rank: int = 64, max_loras: int = 8, gen_memory_share: float = 0.5,
               max_context: int = 8192, shares_device: bool = True, ranks: int = 1,
               expert_lora: bool = True, cuda_graphs: bool = False, parallel: str = "tp",
               checkpoint_tokens: int = 0) -> MemoryPlan:
    """The plan a trainer checks at start (one rank's, in a gang of `ranks` split `parallel`). On a
    GPU it shares the device with vLLM unless told otherwise; on the CPU vLLM's KV cache is its own
    setting, so the trainer plans with the host's available memory."""
    shared = shares_device and not device.startswith("cpu")
    return plan_memory(config, PlanInputs(
        device_bytes=device_bytes(device, configured_memory), dtype=resolve_dtype(dtype, device),
        shared_device=shared, gen_memory_share=gen_memory_share,
        token_budget=token_budget or None, max_lora_rank=max_lora_rank, max_loras=max_loras,
        max_context=max_context, trainer_ranks=ranks, trainer_parallel=parallel, expert_lora=expert_lora,
        cuda_graphs=cuda_graphs and device.startswith("cuda") and ranks == 1, checkpoint_tokens=checkpoint_tokens))


def trainer_plan(config: Mapping, settings, gen, *, max_context: int) -> MemoryPlan:
    """The plan a trainer of these settings (core.settings.TrainerSettings; `gen`: GenPoolSettings,
    for the device it shares) checks at start; the API plans the same to bound a model's context."""
    return for_worker(config, device=settings.device, dtype=settings.dtype, configured_memory=settings.gpu_memory,
                      token_budget=settings.token_budget, max_lora_rank=settings.max_rank, max_loras=gen.max_loras,
                      gen_memory_share=gen.gpu_memory_share, max_context=max_context,
                      shares_device=settings.shares_device, ranks=settings.ranks, expert_lora=settings.expert_lora,
                      cuda_graphs=settings.cuda_graphs, parallel=settings.parallel,
                      checkpoint_tokens=settings.checkpoint_tokens)


def sampler_problems(config: Mapping, *, accelerator: bool, dtype: str, gen_memory_share: float,
                     kv_cache_bytes: int, max_loras: int, max_lora_rank: int, max_context: int,
                     device_memory: int = 0, ranks: int = 1, expert_lora: bool = True) -> list[str]:
    """What stops the generation worker's engine from fitting, checked before vLLM loads anything.
    On a GPU it takes gen_memory_share of the device; on the CPU its KV cache is kv_cache_bytes."""
    resolved = resolve_dtype(dtype, "cuda" if accelerator else "cpu")
    if accelerator:
        plan = plan_memory(config, PlanInputs(device_bytes=device_memory, dtype=resolved,
                                              gen_memory_share=gen_memory_share, max_lora_rank=max_lora_rank,
                                              max_loras=max_loras, max_context=max_context, sampler_ranks=ranks,
                                              expert_lora=expert_lora))
        return list(plan.sampler_problems)
    shape = architectures.Shape.of(config)
    per_token = shape.attention_layers * shape.kv_width * DTYPE_BYTES[resolved]
    if per_token * max_context > kv_cache_bytes:
        return [f"kv_cache_gib: one sequence of {max_context:,} tokens needs "
                f"{per_token * max_context / GiB:.2f} GiB of KV cache, more than the {kv_cache_bytes / GiB:.0f} GiB set; "
                "raise QUILT_GEN_KV_CACHE_GIB or lower QUILT_GEN_MAX_MODEL_LEN"]
    return []


def data_parallel_ways(ranks: int, parallel: str) -> int:
    """Over how many ranks a gang splits a pass's tokens: an FSDP gang's all (data parallel), else one."""
    return ranks if parallel == "fsdp" else 1


def rank_tokens(budget: int, ways: int) -> int:
    """One rank's tokens per micro-batch when `ways` ranks split a pass's `budget`: its share,
    rounded up (a row longer than that still goes alone)."""
    return max(1, -(-budget // ways))


def longest_row(config: Mapping, inputs: PlanInputs) -> int:
    """The longest single row a trainer planned by `inputs` can train: a pass of that row alone
    (checkpointed where `inputs.checkpoint_tokens` says a row that long is; graphs are never captured
    for it) beside the base weights and one resident adapter, as `plan_memory` counts them. 0 when
    not even MIN_TOKEN_BUDGET tokens fit."""
    def fits(tokens: int) -> bool:
        return not plan_memory(config, dataclasses.replace(inputs, token_budget=tokens, resident_adapters=1,
                                                           cuda_graphs=False)).trainer_problems

    # Fitting is monotonic in the length on each side of the checkpointing threshold (a row past it
    # keeps a few vectors a token, one below it every layer's intermediates): search above it first.
    low = max(MIN_TOKEN_BUDGET, inputs.checkpoint_tokens)
    if fits(low):
        high = 2 * low
        while fits(high) and high < 1 << 31:
            low, high = high, high * 2
    elif low > MIN_TOKEN_BUDGET and fits(MIN_TOKEN_BUDGET):
        low, high = MIN_TOKEN_BUDGET, low
    else:
        return 0
    while high - low > 1:  # fits(low), not fits(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def context_gpus(config: Mapping, context: int, inputs: PlanInputs) -> int | None:
    """The fewest GPUs of `inputs.device_bytes` (a tensor-parallel trainer gang on devices of its
    own) on which one row of `context` tokens trains beside one adapter; None where no gang of up to
    64 does: a layer's checkpointed input is whole on every rank of a tensor-parallel gang (and an
    FSDP gang runs a row on one rank), so past that a row needs context parallelism, which Quilt has not."""
    single = dataclasses.replace(inputs, token_budget=context, resident_adapters=1, trainer_parallel="tp",
                                 cuda_graphs=False)
    return fewest_ranks(config, single)[0]


def model_context(requested: int | None, *, base_context: int, standard: int, plan_longest: int | None) -> int:
    """A new training model's context length. Asked for (`requested`): at most the base's own
    (`base_context`) and the longest row the trainer's memory plan can train (`plan_longest`, None
    where the plan is not known here), else a 400 naming `max_context_length` and the limit. Not asked
    for: the `standard` context (0: the base's), never more than the base's or the plan's."""
    limit, why = base_context, f"base model's context length {base_context:,}"
    if plan_longest is not None and plan_longest < limit:
        limit, why = max(plan_longest, 1), (f"longest row the trainer's memory plan can train on this base "
                                            f"({max(plan_longest, 1):,} tokens; quilt models plan --context)")
    if requested is None:
        return min(standard or base_context, limit)
    if requested > limit:
        raise InvalidInput(f"max_context_length: {requested:,} tokens exceed the limit of {limit:,}, the {why}",
                           field="max_context_length")
    return requested
