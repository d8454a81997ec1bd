"""Where a base model comes from, and the checks it passes before it enters the catalogue.

    local_dir, source = locate(path=..., hub=..., revision=...)
    base = describe("my-llama", local_dir, source, ...)     # InvalidInput naming what is wrong
    catalog.register(conn, base)

A hub model is fetched with huggingface_hub into its cache (HF_HOME / HF_HUB_CACHE), which honours
HF_HUB_OFFLINE: offline, only what the cache already holds is found. The workers then load the
snapshot directory like any local model, so one code path serves both.

transformers is imported inside the functions: the CLI's other commands stay quick.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import replace
from pathlib import Path

from bases import architectures
from bases.catalog import BaseModel
from core.errors import InvalidInput
from core.numbers import INT32_MAX
from core.settings import VLLM_LORA_RANKS

DTYPES = ("auto", "bfloat16", "float32")
# Chat renderers Quilt knows, for tokenizers without a chat template (the cookbook's renderer names).
RENDERERS = ("chatml", "llama3", "gemma", "none")
# What a causal LM needs from a hub repository; weights other than safetensors are not loaded.
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def locate(*, path: str | Path | None = None, hub: str | None = None, revision: str | None = None) -> tuple[str, dict]:
    """The local directory of a model given by path or hub id, and its source fields for the
    catalogue. Raises InvalidInput with the fix when it cannot be found."""
    if (path is None) == (hub is None):
        raise InvalidInput("give exactly one of --path and --hub", field="source")
    if path is not None:
        local = Path(path).expanduser().resolve()
        if not local.is_dir():
            raise InvalidInput(f"{local} is not a directory", field="path")
        return str(local), {"source": "path", "hub_id": None, "revision": None, "tokenizer_id": str(local)}
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    assert hub is not None  # exactly one of the two was given
    try:
        snapshot = snapshot_download(hub, revision=revision, allow_patterns=HUB_PATTERNS)
    except LocalEntryNotFoundError:
        where = "the hub cache" + (" (HF_HUB_OFFLINE is set, so nothing is downloaded)" if offline else "")
        raise InvalidInput(f"{hub!r}{'@' + revision if revision else ''} is not in {where}; download it where "
                           "the hub is reachable (huggingface-cli download) or give --path", field="hub") from None
    except HFValidationError as exc:
        raise InvalidInput(f"{hub!r} is not a hub model id: {exc}", field="hub") from None
    except Exception as exc:  # noqa: BLE001 - network, auth and not-found errors all mean "cannot add it"
        raise InvalidInput(f"cannot fetch {hub!r} from the hub: {type(exc).__name__}: {exc}", field="hub") from None
    return snapshot, {"source": "hub", "hub_id": hub, "revision": revision, "tokenizer_id": hub}


def describe(name: str, local_dir: str, source: dict, *, dtype: str = "auto", max_context: int | None = None,
             trainable: bool = True, sampleable: bool = True, renderer: str | None = None,
             serving: dict | None = None) -> BaseModel:
    """Validate a model directory and return its catalogue entry: a loadable config of a supported
    architecture, safetensors weights, a tokenizer that fits the vocabulary, and a chat template or
    a stated renderer."""
    if not name or len(name) > 128 or any(c.isspace() or not c.isprintable() for c in name):
        raise InvalidInput("the model name must be 1-128 printable characters without spaces", field="name")
    if dtype not in DTYPES:
        raise InvalidInput(f"dtype must be one of {DTYPES}, got {dtype!r}", field="dtype")
    if renderer is not None and renderer not in RENDERERS:
        raise InvalidInput(f"renderer must be one of {RENDERERS}, got {renderer!r}", field="renderer")
    _check_serving(serving or {})
    directory = Path(local_dir)
    config = _config(directory)
    arch = architectures.of_config(config)
    if "expert_lora" in (serving or {}) and not arch.moe:
        raise InvalidInput(f"--expert-lora is a setting of mixture-of-experts bases; {arch.family} has no experts",
                           field="expert_lora")
    total, active = _parameters(directory, config)
    text = architectures.text_config(config)
    context = int(text.get("max_position_embeddings") or 0)
    if context < 1:
        raise InvalidInput("config.json has no max_position_embeddings", field="config.max_position_embeddings")
    if max_context is not None:
        if not 1 <= max_context <= context:
            raise InvalidInput(f"--max-context {max_context} must be in [1, {context}] (the model's own limit)",
                               field="max_context")
        context = max_context
    template = _tokenizer_template(directory, int(text["vocab_size"]))
    if arch.vision:
        _check_processor(directory)
        if (serving or {}).get("trainer_ranks", 1) > 1:
            # a gang loads the causal LM alone and plans its experts by the text model's names (batcher.engine.gang)
            raise InvalidInput(f"--trainer-ranks must be 1 for a vision base ({arch.family}): a trainer gang cannot "
                               "split its vision tower", field="trainer_ranks")
    if not template and renderer is None:
        raise InvalidInput(f"the tokenizer has no chat template; pass --renderer (one of {RENDERERS}) to say how "
                           "conversations are rendered", field="renderer")
    return BaseModel(
        name=name, path=str(directory), vocab_size=int(text["vocab_size"]), max_context_length=context,
        trainable=trainable, sampleable=sampleable, architecture=arch.model_type, config=config,
        source=source["source"], hub_id=source["hub_id"], revision=source["revision"], dtype=dtype,
        tokenizer_id=source["tokenizer_id"], renderer=renderer or "", num_parameters=total,
        active_parameters=active, serving=dict(serving or {}),
    )


def _check_processor(directory: Path) -> None:
    """A vision base's image processor (preprocessor_config.json): what turns images into pixels."""
    from bases import vision

    try:
        vision.ImageGeometry.of_directory(directory)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidInput(f"{directory} is a vision base without a usable image processor "
                           f"(preprocessor_config.json): {type(exc).__name__}: {exc}", field="processor") from None


def _check_serving(serving: dict) -> None:
    """Per-base worker settings, checked as the workers' own settings would check them."""
    share = serving.get("gen_memory_share")
    if share is not None and not 0 < share < 1:
        raise InvalidInput(f"--gen-memory-share must be between 0 and 1, got {share}", field="gen_memory_share")
    rank = serving.get("max_lora_rank")
    if rank is not None and rank not in VLLM_LORA_RANKS:
        raise InvalidInput(f"--max-lora-rank must be one of {VLLM_LORA_RANKS}, got {rank}", field="max_lora_rank")
    loras = serving.get("max_loras")
    if loras is not None and not 2 <= loras <= 256:
        raise InvalidInput(f"--max-loras must be in [2, 256], got {loras}", field="max_loras")
    for key in ("trainer_ranks", "tensor_parallel", "pipeline_parallel"):
        value = serving.get(key)
        if value is not None and not 1 <= value <= 64:
            raise InvalidInput(f"--{key.replace('_', '-')} must be in [1, 64], got {value}", field=key)
    for key in ("device", "gen_device"):
        value = serving.get(key)
        if value is not None and (not value or len(value) > 32 or not value.replace(":", "").replace(",", "").isalnum()):
            raise InvalidInput(f"--{key.replace('_', '-')} {value!r} is not a device like cuda:0 (or 0,1)", field=key)


def refreshed(base: BaseModel) -> BaseModel:
    """An entry written before the catalogue knew architectures, filled in from its directory."""
    config = _config(Path(base.path))
    total, active = _parameters(Path(base.path), config)
    return replace(base, architecture=architectures.of_config(config).model_type, config=config,
                   tokenizer_id=base.tokenizer_id or base.path, num_parameters=total, active_parameters=active)


def _parameters(directory: Path, config: dict) -> tuple[int, int]:
    """(total, active per token): the total exact from the weights' headers, less what the config
    says a token does not use (experts not routed to)."""
    total = weights_parameters(directory)
    config_total, config_active = architectures.parameter_counts(config)
    return total, total - (config_total - config_active)


def _config(directory: Path) -> dict:
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise InvalidInput(f"{directory} has no config.json; is it a Hugging Face model directory?",
                           field="config") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"{path} is not valid JSON: {exc}", field="config") from None
    if not isinstance(config, dict):
        raise InvalidInput(f"{path} is not a JSON object", field="config")
    architectures.of_config(config)
    text = architectures.text_config(config)
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
        value = text.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= INT32_MAX:
            raise InvalidInput(f"config.json {key} must be a positive integer up to {INT32_MAX}, got {value!r}",
                               field=f"config.{key}")
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(str(directory))
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for a config it cannot use
        raise InvalidInput(f"transformers cannot load {path}: {type(exc).__name__}: {exc}", field="config") from None
    return config


def safetensors_header(path: str | Path) -> dict:
    """A .safetensors file's header (8-byte little-endian length, then JSON naming every tensor's
    dtype and shape): shapes without torch and without reading the weights. Raises OSError,
    ValueError or struct.error for a file that is not one."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > 100_000_000:
            raise ValueError("header larger than 100 MB")
        header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return header


def weights_parameters(directory: str | Path) -> int:
    """Parameters in a model directory's safetensors weights (sharded or not), from their headers."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = sorted(p.name for p in directory.glob("*.safetensors"))
    if not shards:
        raise InvalidInput(f"{directory} has no .safetensors weights (other formats are not loaded)", field="weights")
    total = 0
    for shard in shards:
        try:
            header = safetensors_header(directory / shard)
        except (OSError, ValueError, struct.error) as exc:
            raise InvalidInput(f"{shard} is not a readable safetensors file: {exc}", field="weights") from None
        total += sum(_stored_parameters(key, meta, header) for key, meta in header.items() if key != "__metadata__")
    return total


def _stored_parameters(key: str, meta: dict, header: dict) -> int:
    """The parameters a stored tensor holds. MXFP4 (gpt-oss's experts: `<name>_blocks` bytes beside
    `<name>_scales`) packs two 4-bit values a byte, and its scales are no parameters of their own."""
    if key.endswith("_blocks") and meta.get("dtype") == "U8" and key[:-len("_blocks")] + "_scales" in header:
        return 2 * math.prod(meta["shape"])
    if key.endswith("_scales") and meta.get("dtype") == "U8" and key[:-len("_scales")] + "_blocks" in header:
        return 0
    return math.prod(meta["shape"])


def _tokenizer_template(directory: Path, vocab_size: int) -> str | None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except Exception as exc:  # noqa: BLE001
        raise InvalidInput(f"the tokenizer in {directory} cannot be loaded: {type(exc).__name__}: {exc}",
                           field="tokenizer") from None
    if len(tokenizer) > vocab_size:
        raise InvalidInput(f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab_size}",
                           field="tokenizer")
    return getattr(tokenizer, "chat_template", None)
