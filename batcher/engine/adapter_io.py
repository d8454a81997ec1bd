"""An adapter in and out of files: PEFT-format exports, training checkpoints, and loading them.

Exports are what PEFT and vLLM read (`adapter_model.safetensors`, `adapter_config.json`); a
training checkpoint adds the optimizer state and the trainer's metadata (`checkpoints.layout`).
Under a gang every tensor is gathered whole (a collective), so a trainer of any size reads it.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bases import architectures
from batcher.engine.adapter import LORA_ALPHA, Adapter
from batcher.engine.multilora import MultiLoraModel, gather
from checkpoints.layout import ADAPTER_WEIGHTS, OPTIMIZER_FILE, TrainerMeta
from core.errors import InvalidInput

_SHAPE_KEYS = ("rank", "train_attn", "train_mlp", "train_unembed")


@dataclass(frozen=True)
class Saved:
    """A checkpoint directory read into host memory: whole PEFT weights, optimizer state if asked for."""

    meta: TrainerMeta
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None


def read_saved(directory: str, *, optimizer: bool) -> Saved:
    """Read a training checkpoint (or an export, without `optimizer`) into host memory."""
    from safetensors.torch import load_file

    src = Path(directory)
    meta = TrainerMeta.read(src)
    return Saved(meta, load_file(str(src / ADAPTER_WEIGHTS)),
                 torch.load(src / OPTIMIZER_FILE, weights_only=True) if optimizer else None)


def peft_config(adapter: Adapter, config: dict[str, Any], base_path: str) -> Any:
    """The adapter_config.json that PEFT and vLLM read."""
    from peft import LoraConfig

    targets = architectures.lora_targets(config, adapter.lora_config)
    return LoraConfig(r=int(adapter.lora_config["rank"]), lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                      target_modules=architectures.peft_modules(targets),
                      target_parameters=architectures.peft_parameters(config, targets) or None,
                      bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_path)


def optimizer_state(lora: MultiLoraModel, adapter: Adapter) -> dict[str, Any]:
    """The adapter's optimizer state dict with whole moments (gathered over a gang: the shares of a
    split layer's A or B are joined as the weights are), so a gang of any size can load it."""
    state = adapter.optimizer.state_dict()
    shares = lora.shares(adapter.name)
    if not any(axis is not None for _, axis in shares):
        return state
    return {**state, "state": {i: {k: gather(shares[i][0], v, shares[i][1]) if k != "step" else v
                                   for k, v in entry.items()}
                               for i, entry in state["state"].items()}}


def _load_optimizer_state(lora: MultiLoraModel, adapter: Adapter, state: dict[str, Any]) -> None:
    """Load whole saved moments, each rank keeping its share of a split layer's."""
    shares = lora.shares(adapter.name)
    if any(axis is not None for _, axis in shares):
        local = {}
        for i, entry in state["state"].items():
            split, axis = shares[int(i)]
            local[int(i)] = {k: split.local(v, axis).clone() if k != "step" and split is not None and axis is not None
                             else v for k, v in entry.items()}
        state = {**state, "state": local}
    adapter.optimizer.load_state_dict(state)


def writer(dest: Path, state: dict[str, torch.Tensor], config: Any, optimizer: dict[str, Any] | None,
           meta: TrainerMeta) -> Callable[[], int]:
    """The function that writes what an export took, from any thread: beside the target, then
    renamed over it, so a reader never sees half a checkpoint; it returns the bytes written."""
    from safetensors.torch import save_file

    def write() -> int:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=dest.parent))
        try:
            save_file({k: v.contiguous().cpu() for k, v in state.items()}, str(tmp / ADAPTER_WEIGHTS))
            config.save_pretrained(str(tmp))
            if optimizer is not None:
                torch.save(optimizer, tmp / OPTIMIZER_FILE)
            meta.write(tmp)
            if dest.exists():
                shutil.rmtree(dest)
            tmp.rename(dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return sum(f.stat().st_size for f in dest.iterdir())

    return write


def load_saved(lora: MultiLoraModel, adapter: Adapter, saved: Saved,
               new_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> None:
    """Load a checkpoint already read into an adapter of the same LoRA shape (a user error naming the
    difference otherwise); clears its gradients. Without saved optimizer state the optimizer
    starts fresh (Tinker's load_state semantics)."""
    ours = adapter.lora_config
    if saved.optimizer is not None and saved.meta.optimizer != adapter.family:
        raise InvalidInput(f"checkpoint holds {saved.meta.optimizer} optimizer state but this model's optimizer is "
                           f"{adapter.family} (fixed at create_model); load its weights alone (optimizer=False) or "
                           f"into a model created with {saved.meta.optimizer}", field="path")
    for key in _SHAPE_KEYS:
        if saved.meta.lora_config.get(key, True) != ours.get(key, True):
            raise InvalidInput(f"checkpoint has lora_config.{key}={saved.meta.lora_config.get(key)!r} but this "
                               f"model has {ours.get(key)!r}", field="path")
    try:
        lora.load_state_dict(adapter.name, saved.weights)
    except ValueError as exc:
        raise InvalidInput(f"checkpoint does not fit this model: {exc}", field="path") from None
    lora.clear_grads(adapter.name)
    adapter.optimizer = new_optimizer(adapter.params)
    if saved.optimizer is not None:
        _load_optimizer_state(lora, adapter, saved.optimizer)
    adapter.steps = saved.meta.steps
