"""Which losses exist and which per-token inputs each takes. Torch-free, so the API can validate
requests without importing the trainer; `batcher.losses` implements the math and reuses this table."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

# Input keys whose wire dtype is integer (Tinker's table); every other known key is float32.
INT_INPUTS = frozenset({"target_tokens"})


@dataclass(frozen=True)
class LossSpec:
    """The `loss_fn_inputs` keys a built-in loss requires and accepts."""

    name: str
    required_inputs: frozenset[str]
    optional_inputs: frozenset[str]

    @property
    def allowed_inputs(self) -> frozenset[str]:
        return self.required_inputs | self.optional_inputs


_RL_REQUIRED = frozenset({"target_tokens", "logprobs", "advantages"})
_CLIP_INPUTS = frozenset({"clip_low_threshold", "clip_high_threshold"})

# `weights` is accepted everywhere (Tinker's RL examples send it); on RL losses it only masks the
# trainer-sampler mismatch metrics. `logprobs` on cross_entropy likewise only feeds those metrics.
LOSS_FUNCTIONS: Mapping[str, LossSpec] = MappingProxyType(
    {
        "cross_entropy": LossSpec("cross_entropy", frozenset({"target_tokens"}), frozenset({"weights", "logprobs"})),
        "importance_sampling": LossSpec("importance_sampling", _RL_REQUIRED, frozenset({"weights"})),
        "ppo": LossSpec("ppo", _RL_REQUIRED, frozenset({"weights"}) | _CLIP_INPUTS),
        "cispo": LossSpec("cispo", _RL_REQUIRED, frozenset({"weights"}) | _CLIP_INPUTS),
        "dro": LossSpec("dro", _RL_REQUIRED, frozenset({"weights"})),
    }
)
