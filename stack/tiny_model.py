"""A tiny random-weight model (Qwen3 by default; any architecture of bases.architectures) with its
own byte-level BPE tokenizer, built locally.

Why this exists: Quilt runs where no model hub can be reached, yet its tests and its embedded mode
need a base model with a real architecture: one that transformers and PEFT load through the Auto
classes, that LoRA can target on every projection, and that vLLM's CPU backend can serve. Nothing
can be downloaded, so we make one in a few seconds from code alone: a Qwen3 config with random
weights (deterministic from a seed) and a tokenizer trained on a synthetic corpus generated here.

The weights are random, so the model says nothing sensible; what matters is that it is a genuine
model in Hugging Face format (config.json, generation_config.json, model.safetensors, tokenizer.json,
tokenizer_config.json) whose output distributions are peaked enough (larger `initializer_range`)
that comparing logprobs between two implementations, or before and after a LoRA step, is
meaningful.

transformers, tokenizers and torch are imported inside the functions so that importing this module
stays cheap (the API process imports it only to read model info).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

TINY_MODEL_NAME = "quilt/tiny-qwen3"


def tiny_model_name(architecture: str = "qwen3") -> str:
    """The catalogue name of the tiny model of an architecture ("quilt/tiny-llama", ...)."""
    return f"quilt/tiny-{architecture.replace('_', '-')}"

# Head sizes vLLM's CPU attention backend has kernels for; any other size fails at engine start,
# long after the model was built, so we refuse it up front.
VLLM_CPU_HEAD_DIMS = frozenset({32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512})

# A tiny gpt-oss's sliding-window width (tokens a query sees, itself included): shorter than the
# test rows, so the sliding layers' masks matter.
GPT_OSS_TINY_WINDOW = 8
# Multimodal configs whose text shape lives in a text_config this spec does not fill (built as is,
# one would be the default 9 B language model): their `_text` language models are built instead.
NOT_BUILT = ("qwen3_5", "qwen3_5_moe")

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
# A vision base's tokens, added after the shared vocabulary (so every other id means the same): an
# image is <|vision_start|>, one <|image_pad|> per merged patch, <|vision_end|> (Qwen3-VL's names).
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# The tiny vision tower's image processor: 16-pixel patches merged 2 x 2, so one image token per
# 32 x 32 pixels, between 1 and 16 tokens an image (images are resized into that range).
TINY_PATCH, TINY_MERGE = 16, 2
TINY_MIN_PIXELS, TINY_MAX_PIXELS = 32 * 32, 128 * 128

# The files vLLM and transformers need to load the model. The build renames a finished temp dir
# into place, so a directory holding all of them is a finished build, never a half-written one.
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

# Records the seed and spec a directory was built from, so that asking for a different model at the
# same path is an error instead of silently getting the old one.
PROVENANCE_FILE = "quilt_tiny_model.json"

# The corpus has its own fixed seed, independent of the weight seed, so every tiny model shares one
# tokenizer: token ids mean the same thing across models built with different seeds.
_CORPUS_SEED = 20240607
_CORPUS_SENTENCES = 6000


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model. Defaults give about 3.7 M parameters (fp32, about 15 MB)."""

    # Upper bound on the tokenizer's vocabulary, special tokens and the 256 byte tokens included
    # (>= 259). The model's vocab_size is the trained tokenizer's actual size, which is smaller
    # when the synthetic corpus runs out of merges (it reaches 1024, not tens of thousands).
    vocab_size: int = 1024
    # Width of the residual stream (>= 1).
    hidden_size: int = 256
    # Number of decoder layers (>= 1).
    num_layers: int = 4
    # Query heads per layer (>= 1, a multiple of num_key_value_heads).
    num_attention_heads: int = 4
    # Key/value heads per layer (grouped-query attention; >= 1, divides num_attention_heads).
    num_key_value_heads: int = 2
    # Size of one attention head; must be in VLLM_CPU_HEAD_DIMS. Qwen3 does not tie it to
    # hidden_size / num_attention_heads.
    head_dim: int = 64
    # Width of the SwiGLU MLP (>= 1).
    intermediate_size: int = 768
    # Longest sequence in tokens (prompt + completion) the model is configured for (>= 1).
    max_position_embeddings: int = 2048
    # Std-dev of the normal weight init (> 0). Qwen's own 0.02 gives near-uniform outputs; with 0.1
    # the logits' spread is about 0.1 * sqrt(hidden_size) = 1.6, so a random model's next-token
    # distributions are far from uniform (about 5.8 nats of entropy against 6.9) and logprob
    # comparisons mean something.
    initializer_range: float = 0.1
    # False keeps lm_head a separate Linear, so LoRA can target it (architectures that always tie,
    # like Gemma, tie regardless).
    tie_word_embeddings: bool = False
    # transformers model_type, one of bases.architectures.SUPPORTED. Every architecture shares the
    # one tokenizer, so token ids mean the same across them.
    architecture: str = "qwen3"
    # Mixture-of-experts shape (used only by MoE architectures): experts per layer, experts each
    # token is routed to, and the width of one expert's MLP.
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 192
    # Multi-head latent attention and the MoE layout around it (deepseek_v3 only): the latent's
    # and the queries' low ranks, the rotary part of a head (vLLM's CPU MLA kernel takes only
    # kv_lora_rank 512 with qk_rope_head_dim 64; head_dim is each head's non-rotary query/key and its
    # value width), shared experts beside the routed ones, and the dense layers before the first MoE.
    q_lora_rank: int = 96
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    # The model's vocabulary is padded to this many rows (0: the tokenizer's size), as real models
    # pad theirs; a real-size shape for benchmarks (e.g. 151,936 for Qwen3) without a real tokenizer.
    pad_vocab_to: int = 0
    # Dtype the weights are created and saved in ("float32" or "bfloat16"; big benchmark shapes).
    dtype: str = "float32"

    def validate(self) -> None:
        """Raise ValueError when the spec would build a model transformers or vLLM cannot use."""
        if self.head_dim not in VLLM_CPU_HEAD_DIMS:
            raise ValueError(
                f"head_dim={self.head_dim} is not supported by vLLM's CPU backend; "
                f"use one of {sorted(VLLM_CPU_HEAD_DIMS)}"
            )
        # 256 byte tokens plus the special tokens are always present.
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(f"vocab_size={self.vocab_size} must be >= {256 + len(SPECIAL_TOKENS)}")
        for field in (
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "max_position_embeddings",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field}={value!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if not self.initializer_range > 0:
            raise ValueError(f"initializer_range={self.initializer_range} must be > 0")
        from bases.architectures import SUPPORTED

        if self.architecture not in SUPPORTED:
            raise ValueError(f"architecture={self.architecture!r} must be one of {sorted(SUPPORTED)}")
        if self.architecture in NOT_BUILT:
            raise ValueError(f"architecture={self.architecture!r}: build its language model, "
                             f"{self.architecture}_text, instead")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts]")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r} must be float32 or bfloat16")


def buildable_architectures() -> list[str]:
    """The architectures a tiny model is built of (`quilt models create-tiny --architecture`)."""
    from bases.architectures import SUPPORTED

    return sorted(a for a in SUPPORTED if a not in NOT_BUILT)


@dataclass(frozen=True)
class TinyModelInfo:
    """What callers need to know about a built model without loading it."""

    path: str  # the model directory, loadable with from_pretrained / vLLM
    vocab_size: int  # model vocab size: len(tokenizer), or more when padded (pad_vocab_to)
    max_context_length: int  # tokens, from max_position_embeddings
    num_parameters: int  # total parameter count, from the safetensors header
    eos_token_id: int
    name: str = TINY_MODEL_NAME  # the base-model name clients use


def build_tiny_model(
    out_dir: Path, *, seed: int = 0, spec: TinyModelSpec = TinyModelSpec()
) -> TinyModelInfo:
    """Build the tiny model into `out_dir` (if not already there) and return its info.

    Idempotent: a directory that already holds a complete model is returned as is. The build goes
    to a temporary sibling directory that is renamed into place only when complete, so a crash
    never leaves something that looks like a model, and concurrent builders of the same path do not
    clash (the loser of the rename discards its copy and uses the winner's).
    """
    spec.validate()
    out_dir = Path(out_dir)

    if _is_complete(out_dir):
        _check_provenance(out_dir, seed, spec)
        return read_model_info(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        # Not ours to delete: it may be someone's data, or a model another tool is still writing.
        raise FileExistsError(f"{out_dir} exists and is not a complete model; remove it first")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _build_into(tmp, seed=seed, spec=spec)
        # mkdtemp makes the directory private (0700); the model is meant to be read by servers.
        os.chmod(tmp, 0o755)
        _fsync_tree(tmp)
        try:
            # Atomic; replaces out_dir only if it is an empty directory.
            os.rename(tmp, out_dir)
        except OSError:
            if not _is_complete(out_dir):
                raise
            # Another process finished the same build first; theirs is as good as ours.
            log.info("tiny model at %s was built concurrently; using that one", out_dir)
            _check_provenance(out_dir, seed, spec)
        else:
            _fsync_dir(out_dir.parent)
            log.info("built tiny model at %s in %.1f s", out_dir, time.monotonic() - started)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return read_model_info(out_dir)


def read_model_info(path: Path | str, *, name: str = TINY_MODEL_NAME) -> TinyModelInfo:
    """Read a model directory's info from config.json and the safetensors header (no torch)."""
    from bases.model_sources import weights_parameters

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    config = config.get("text_config") or config
    eos = config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0]
    if eos is None:
        raise ValueError(f"{path}/config.json has no eos_token_id")
    return TinyModelInfo(
        path=str(path),
        vocab_size=int(config["vocab_size"]),
        max_context_length=int(config["max_position_embeddings"]),
        num_parameters=weights_parameters(path),
        eos_token_id=int(eos),
        name=name,
    )


# --- building ---------------------------------------------------------------------------------


def _build_into(dest: Path, *, seed: int, spec: TinyModelSpec) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import (
        AutoModelForCausalLM,
        GenerationConfig,
        PreTrainedTokenizerFast,
    )

    backend = _train_tokenizer(spec.vocab_size)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        # Qwen's convention: one token ends documents, pads, and stands in as BOS. The tokenizer
        # does not insert BOS itself; the id is set so configs agree.
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        model_max_length=spec.max_position_embeddings,
    )
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    assert isinstance(eos_id, int)  # one token in, one id out
    from bases.architectures import SUPPORTED

    vision = SUPPORTED[spec.architecture].vision
    if vision:
        tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:] + VISION_TOKENS)})
    vocab_size = max(len(tokenizer), spec.pad_vocab_to)

    config = _config(spec, vocab_size=vocab_size, eos_id=eos_id)
    if vision:
        config = _vision_config(spec, config, tokenizer)
    # fork_rng: seeding must not disturb the caller's global RNG stream (e.g. a test's).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if vision:
            from transformers import AutoModelForImageTextToText

            model = AutoModelForImageTextToText.from_config(config, dtype=getattr(torch, spec.dtype))
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, spec.dtype))
        if spec.architecture == "gpt_oss":
            # transformers starts its attention and expert biases at zero; random ones make the
            # tests see whether every bias is applied
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("bias") and not p.any():
                        p.normal_(0.0, spec.initializer_range)
        if spec.architecture == "deepseek_v3":
            # transformers starts the routers' score-correction bias (a buffer) at zero; a random one makes
            # the biased choice of experts differ from the unbiased scores' (what the tests must follow)
            with torch.no_grad():
                for name, b in model.named_buffers():
                    if name.endswith("e_score_correction_bias"):
                        b.normal_(0.0, spec.initializer_range)
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id
    )
    model.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)
    if vision:
        _save_processor(dest, tokenizer)
    (dest / PROVENANCE_FILE).write_text(
        json.dumps({"seed": seed, "spec": dataclasses.asdict(spec)}, indent=2, sort_keys=True)
    )
    missing = [f for f in REQUIRED_FILES if not (dest / f).is_file()]
    if missing:
        # A transformers upgrade could rename or shard files; better to fail here than at serving.
        raise RuntimeError(f"tiny model build did not produce {missing}")


def _config(spec: TinyModelSpec, *, vocab_size: int, eos_id: int):
    """The transformers config of `spec.architecture`; the shape fields mean the same for all."""
    from transformers import AutoConfig

    from bases.architectures import SUPPORTED

    arch = SUPPORTED[spec.architecture]
    extra = {}
    intermediate = spec.intermediate_size
    if spec.architecture == "gpt_oss":
        # Every layer is MoE (its intermediate_size is one expert's width); sliding and full
        # attention alternate, with a window short enough that the tests' rows cross it. vLLM reads
        # its YaRN rope parameters by name, so they are all spelled out.
        intermediate = spec.moe_intermediate_size
        extra = {"num_local_experts": spec.num_experts, "num_experts_per_tok": spec.num_experts_per_tok,
                 "sliding_window": GPT_OSS_TINY_WINDOW,
                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}}
    elif arch.moe:
        extra = {"num_experts": spec.num_experts, "num_experts_per_tok": spec.num_experts_per_tok,
                 "moe_intermediate_size": spec.moe_intermediate_size, "decoder_sparse_step": 1,
                 "mlp_only_layers": [], "norm_topk_prob": True}
    if arch.mla:
        extra = {"n_routed_experts": spec.num_experts, "num_experts_per_tok": spec.num_experts_per_tok,
                 "moe_intermediate_size": spec.moe_intermediate_size, "n_shared_experts": spec.n_shared_experts,
                 "first_k_dense_replace": spec.first_k_dense_replace, "n_group": 1, "topk_group": 1,
                 "q_lora_rank": spec.q_lora_rank, "kv_lora_rank": spec.kv_lora_rank,
                 "qk_rope_head_dim": spec.qk_rope_head_dim, "qk_nope_head_dim": spec.head_dim,
                 "v_head_dim": spec.head_dim,
                 # what transformers implements and published configs say; vLLM reads them (its
                 # defaults are softmax scores without the correction bias)
                 "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                 # (every head has its own key and value, from the latent; transformers' eager attention
                 # would repeat them by num_attention_heads / num_key_value_heads)
                 "num_key_value_heads": spec.num_attention_heads}
    if arch.linear_attention:
        # linear, full, linear, full...: both kinds in every model of two or more layers; a shared
        # expert as wide as one routed expert (Qwen3.5-MoE has one)
        extra |= {"layer_types": ["full_attention" if i % 2 else "linear_attention" for i in range(spec.num_layers)],
                  "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
                  "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4}
        if arch.moe:
            extra["shared_expert_intermediate_size"] = spec.moe_intermediate_size
    return AutoConfig.for_model(
        spec.architecture,
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=intermediate,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        **{"num_key_value_heads": spec.num_key_value_heads, **extra},
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=spec.tie_word_embeddings or arch.ties_embeddings,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        bos_token_id=eos_id,
        dtype=spec.dtype,
    )


def _vision_config(spec: TinyModelSpec, text, tokenizer):
    """A Qwen3-VL config around the text config `text`: a two-block vision tower of width 64 whose
    merger feeds the decoder's width, one deepstack layer, and multimodal rotary sections summing to
    half the head size."""
    from transformers import AutoConfig

    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in zip(
        ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), VISION_TOKENS)}
    half = spec.head_dim // 2
    section = [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]
    # (text's own nested text_config, if it has one, would make transformers' KV cache read a dict as a config)
    text_dict = {k: v for k, v in text.to_dict().items()
                 if k not in ("model_type", "architectures", "transformers_version", "text_config", "vision_config")}
    text_dict.update(ids)  # not Qwen's own ids (151652...), outside this vocabulary
    text_dict["rope_parameters"] = {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": section,
                                    "mrope_interleaved": True}
    return AutoConfig.for_model(
        spec.architecture, text_config=text_dict,
        vision_config={"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
                       "out_hidden_size": spec.hidden_size, "patch_size": TINY_PATCH, "spatial_merge_size": TINY_MERGE,
                       "temporal_patch_size": 2, "num_position_embeddings": 64, "deepstack_visual_indexes": [0],
                       "initializer_range": spec.initializer_range},
        tie_word_embeddings=text.tie_word_embeddings, dtype=spec.dtype, **ids)


def _save_processor(dest: Path, tokenizer) -> None:
    """The image processor a vision base's directory carries (preprocessor_config.json), built here.
    The PIL one: torchvision is not a dependency, and both compute the same pixels."""
    from transformers import Qwen2VLImageProcessorPil

    size = {"shortest_edge": TINY_MIN_PIXELS, "longest_edge": TINY_MAX_PIXELS}
    Qwen2VLImageProcessorPil(patch_size=TINY_PATCH, merge_size=TINY_MERGE, temporal_patch_size=2, size=size,
                             image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(dest)


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # add_prefix_space=False so decode(encode(s)) == s exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, so any text (any language, any byte) can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(_synthetic_corpus(), trainer=trainer)
    return tok


_WORDS = ["the", "a", "an", "and", "or", "but", "not", "of", "to", "in", "on", "at", "by", "for", "with", "from", "into", "over", "under", "after", "before", "is", "are", "was", "were", "be", "been", "has", "have", "had", "do", "does", "did", "can", "will", "would", "should", "could", "may", "might", "must", "i", "you", "he", "she", "it", "we", "they", "me", "him", "her", "us", "them", "my", "your", "his", "its", "our", "their", "this", "that", "these", "those", "cat", "dog", "bird", "fish", "horse", "cow", "sheep", "mouse", "fox", "bear", "wolf", "lion", "tiger", "rabbit", "duck", "frog", "snake", "owl", "tree", "flower", "grass", "river", "lake", "sea", "mountain", "hill", "forest", "field", "road", "house", "door", "window", "garden", "city", "town", "village", "school", "market", "bridge", "tower", "castle", "island", "valley", "desert", "cloud", "rain", "snow", "sun", "moon", "star", "sky", "wind", "fire", "water", "stone", "sand", "wood", "iron", "gold", "silver", "paper", "glass", "bread", "milk", "apple", "banana", "orange", "grape", "lemon", "cherry", "carrot", "potato", "tomato", "onion", "rice", "cheese", "egg", "honey", "tea", "red", "blue", "green", "yellow", "black", "white", "brown", "purple", "pink", "grey", "small", "big", "little", "large", "old", "new", "young", "fast", "slow", "hot", "cold", "warm", "cool", "bright", "dark", "happy", "sad", "quiet", "loud", "soft", "hard", "long", "short", "run", "walk", "jump", "swim", "fly", "eat", "drink", "sleep", "read", "write", "sing", "dance", "play", "work", "open", "close", "build", "see", "look", "watch", "hear", "listen", "speak", "say", "tell", "ask", "answer", "think", "know", "learn", "teach", "give", "take", "make", "find", "keep", "hold", "carry", "bring", "send", "buy", "sell", "pay", "count", "add", "subtract", "multiply", "divide", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "hundred", "thousand", "first", "second", "last", "next", "morning", "evening", "night", "day", "week", "month", "year", "today", "tomorrow", "yesterday", "always", "never", "often", "here", "there", "where", "when", "why", "how", "what", "who", "which", "because", "while", "until", "again", "also", "very", "too", "model", "token", "train", "sample", "loss", "adapter", "weight", "layer", "batch", "step", "learning", "rate", "gradient", "data", "text", "number", "sum", "result", "value", "list", "table", "line", "word", "letter", "question", "story", "example"]  # noqa: E501 - one word list

_NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy", "mallory", "nina", "oscar", "peggy"]


def _synthetic_corpus():
    """Yield a fixed sequence of short texts: prose, arithmetic, counting, code-like lines.

    The mix is chosen so BPE learns whole words, digit groups and operators, and the trained
    vocabulary reaches the default 1024 entries.
    """
    rng = random.Random(_CORPUS_SEED)
    w = rng.choice
    for _ in range(_CORPUS_SENTENCES):
        kind = rng.randrange(8)
        if kind == 0:
            a, b = rng.randrange(100), rng.randrange(100)
            yield f"{a}+{b}={a + b}"
        elif kind == 1:
            a, b = rng.randrange(20), rng.randrange(20)
            op, val = w([("*", a * b), ("-", a - b), ("+", a + b)])
            yield f"what is {a} {op} {b}? the answer is {val}."
        elif kind == 2:
            n = rng.randrange(2, 12)
            yield " ".join(w(_WORDS) for _ in range(n)) + w([".", "!", "?", ",", ";"])
        elif kind == 3:
            name = w(_NAMES)
            sentence = f"{name} has {rng.randrange(1, 50)} {w(_WORDS)}s and {w(_WORDS)} {w(_WORDS)}."
            yield sentence.capitalize()
        elif kind == 4:
            start = rng.randrange(1000)
            yield ", ".join(str(start + i) for i in range(rng.randrange(3, 8)))
        elif kind == 5:
            var = w("xyzabcn")
            yield f"def {w(_WORDS)}_{w(_WORDS)}({var}):\n    return {var} + {rng.randrange(10)}"
        elif kind == 6:
            yield " ".join(
                "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randrange(1, 6)))
                for _ in range(rng.randrange(2, 6))
            )
        else:
            subject, verb, obj = w(_WORDS), w(_WORDS), w(_WORDS)
            yield f"The {w(_WORDS)} {subject} will {verb} the {obj} {w(_NAMES).title()} saw."


# --- reading and bookkeeping -----------------------------------------------------------------


def _is_complete(path: Path) -> bool:
    return path.is_dir() and all((path / f).is_file() for f in REQUIRED_FILES)


def _check_provenance(path: Path, seed: int, spec: TinyModelSpec) -> None:
    record = path / PROVENANCE_FILE
    if not record.is_file():
        # A model built by something else (e.g. copied in by an operator): trust it.
        return
    built = json.loads(record.read_text())
    # Fields added to the spec later take their defaults in a record written before them.
    built["spec"] = {**dataclasses.asdict(TinyModelSpec()), **built.get("spec", {})}
    wanted = {"seed": seed, "spec": dataclasses.asdict(spec)}
    if built != wanted:
        raise ValueError(
            f"{path} holds a tiny model built with {built}, not the requested {wanted}; "
            "use another directory or remove this one"
        )


def _fsync_tree(root: Path) -> None:
    # Without this, a power loss after the rename could leave the final name pointing at files
    # whose data never reached the disk.
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
