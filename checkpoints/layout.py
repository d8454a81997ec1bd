"""What a checkpoint is on disk: the directory layout, the file names, and the trainer's metadata.

    <checkpoint root>/<tenant>/<model>/<kind>/<name>/<version>/
        adapter_config.json          PEFT's LoRA config (what PEFT and vLLM read)
        adapter_model.safetensors    the adapter's weights, under PEFT's key names
        quilt_state.json             {"lora_config": ..., "steps": optimizer steps (the policy version),
                                      "optimizer": the model's optimizer family, "adamw" or "dimuon"}
        optimizer.pt                 that optimizer's state; training checkpoints (`weights`) only

`kind` is `weights` (training checkpoints), `sampler_weights` (publications for sampling) or
`external_weights` (the adapter alone, exported for download).
Every save gets a fresh `<version>` directory and a directory is never rewritten, so a reader of
one version (the generation pool, a download) is never disturbed by a later save; checkpoints.retention
deletes versions nobody names any more.

One torch-free module, shared by the trainer (which writes the tensors), the generation pool
(which checks and serves them) and the dashboard (which archives the adapter for download).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.work import ADAMW

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
META_FILE = "quilt_state.json"

TRAINING_KIND = "weights"
SAMPLER_KIND = "sampler_weights"
EXTERNAL_KIND = "external_weights"  # the adapter alone, exported for download (save_weights_external)
ENCRYPTED_SUFFIX = ".age"  # an export encrypted to its owner holds <file>.age for each file (checkpoints.encryption)


def new_version_dir(checkpoint_dir: Path, tenant_id: str, model_id: str, kind: str, name: str) -> str:
    """A fresh directory for one save of checkpoint `name` (never an existing one)."""
    version = f"{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:8]}"
    return str(checkpoint_dir / tenant_id / model_id / kind / name / version)


@dataclass(frozen=True)
class TrainerMeta:
    """What the trainer records beside every saved adapter."""

    lora_config: dict[str, Any]
    steps: int  # optimizer steps taken when saved: the weights' policy version
    optimizer: str = ADAMW  # the model's optimizer family: what optimizer.pt holds (checkpoints before it: AdamW)

    def write(self, directory: str | Path) -> None:
        (Path(directory) / META_FILE).write_text(json.dumps({"lora_config": self.lora_config, "steps": self.steps,
                                                             "optimizer": self.optimizer}))

    @classmethod
    def read(cls, directory: str | Path) -> TrainerMeta:
        obj = json.loads((Path(directory) / META_FILE).read_text())
        return cls(dict(obj.get("lora_config") or {}), int(obj.get("steps", 0)), str(obj.get("optimizer", ADAMW)))


def policy_version(directory: str | Path) -> int:
    """Optimizer steps the weights had taken when saved (0 if the trainer did not say)."""
    try:
        return TrainerMeta.read(directory).steps
    except (OSError, ValueError, TypeError):
        return 0


def adapter_files(directory: Path) -> list[Path]:
    """The files that make the adapter: everything a checkpoint directory holds except optimizer
    state (a training checkpoint's Adam moments are not part of the adapter, and are twice its
    size). Plain files only: nothing reached through a link is ever sent. FileNotFoundError when
    the config or the weights are missing: a directory half deleted is not an adapter."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and not p.is_symlink() and p.name != OPTIMIZER_FILE)
    missing = {ADAPTER_CONFIG, ADAPTER_WEIGHTS} - {p.name.removesuffix(ENCRYPTED_SUFFIX) for p in files}
    if missing:
        raise FileNotFoundError(f"{directory} has no {', '.join(sorted(missing))}")
    return files
