"""Which losses exist, which per-token inputs each takes, and `loss_fn_config` parsed and checked.
Torch-free, so the API validates requests without importing the trainer (a bad key or value is an
HTTP 400 naming it, never a failed future); `batcher.engine.losses` implements the math over these types."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any

from core import numbers
from core.errors import InvalidInput

# Input keys whose wire dtype is integer (Tinker's table); every other known key is float32.
INT_INPUTS = frozenset({"target_tokens"})

# Top-K distillation: `cross_entropy` takes `target_tokens` and `weights` of shape (N, K), K candidate
# ids per position (tinker's soft targets, e.g. a teacher's top-K renormalised). The inputs that may
# be 2-D, and the widest K accepted (the sampler's top-K logprobs go to 20 by default; a K past this
# bound costs the trainer memory for nothing a teacher would give).
WIDE_INPUTS = frozenset({"target_tokens", "weights"})
MAX_TARGET_WIDTH = 128


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

# Tinker's off-policy REINFORCE (alpha): the loss reads what the sampler recorded, not the client's
# logprobs. Tinker does not publish its formula; Quilt's is in batcher.engine.losses. Its importance
# ratio is kept only inside [1/C, C]; C is `is_weight_cap`, this by default.
STABLE_REINFORCE = "stable_reinforce"
STABLE_REINFORCE_CAP = 2.0
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
        # GSPO-token: the sequence's ratio over the positions `sequence_ratio_mask` marks.
        "gspo": LossSpec("gspo", _RL_REQUIRED | {"sequence_ratio_mask"}, frozenset({"weights"}) | _CLIP_INPUTS),
        # Needs provenance naming sequences sampled with record_stability_info (api.provenance).
        STABLE_REINFORCE: LossSpec(STABLE_REINFORCE, _RL_REQUIRED, frozenset({"weights"})),
    }
)


# A loss the client uploaded (`core.custom_loss`), named per request by `loss_fn_config.loss_id`.
CUSTOM = "custom"


def spec_of(loss_fn: object) -> LossSpec:
    """The loss's input table; InvalidInput (field `loss_fn`) naming the choices otherwise."""
    spec = LOSS_FUNCTIONS.get(loss_fn) if isinstance(loss_fn, str) else None
    if spec is None:
        raise InvalidInput(f"loss_fn {loss_fn!r} is not supported; it must be one of {', '.join(LOSS_FUNCTIONS)}, "
                           f"or {CUSTOM!r} with a loss_id from create_custom_loss",
                           field="loss_fn")
    return spec


# ---------------------------------------------------------------------------------------------
# loss_fn_config


def _config_error(key: str, message: str) -> InvalidInput:
    return InvalidInput(f"loss_fn_config.{key} {message}", field=f"loss_fn_config.{key}")


def _check_number(name: str, value: object, *, low: float, high: float | None = None, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _config_error(name, f"must be a number, got {value!r}")
    if numbers.real(value) is None:
        raise _config_error(name, f"must be {numbers.describe(numbers.FLOAT64_MAX)}, got {str(value)[:40]}")
    too_low = value <= low if low_open else value < low
    if too_low or (high is not None and value > high):
        bound = f"> {low}" if low_open else f">= {low}"
        if high is not None:
            bound += f" and <= {high}"
        raise _config_error(name, f"must be {bound}, got {value!r}")


def _check_int(name: str, value: object, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _config_error(name, f"must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class LossConfig:
    """`loss_fn_config`, parsed. Keys that do not apply to the chosen loss have no effect."""

    clip_low_threshold: float = 0.8  # ratio clip floor, 0 <= lo <= 1 (ppo, cispo, gspo)
    clip_high_threshold: float = 1.2  # ratio clip ceiling, hi >= 1 (ppo, cispo, gspo)
    beta: float = 1.0  # DRO quadratic-penalty coefficient, >= 0 (see batcher.engine.losses)
    is_weight_cap: float | None = None  # TIS cap C > 0 on the importance ratio; None = no cap
    # (stable_reinforce: its band [1/C, C], STABLE_REINFORCE_CAP when None)
    max_staleness: int | None = None  # datums with policy lag > this get zero loss; >= 0
    current_policy_version: int | None = None  # set by the trainer, never by the user
    policy_version: int | None = None  # version the request's data was sampled with (a datum's own wins)

    def __post_init__(self) -> None:
        _check_number("clip_low_threshold", self.clip_low_threshold, low=0.0, high=1.0)
        _check_number("clip_high_threshold", self.clip_high_threshold, low=1.0)
        _check_number("beta", self.beta, low=0.0)
        if self.is_weight_cap is not None:
            _check_number("is_weight_cap", self.is_weight_cap, low=0.0, low_open=True)
        for name in ("max_staleness", "current_policy_version", "policy_version"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), low=0)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> LossConfig:
        return cls(**obj)


CONFIG_KEYS: tuple[str, ...] = (
    "clip_low_threshold",
    "clip_high_threshold",
    "beta",
    "is_weight_cap",
    "max_staleness",
    "policy_version",
)
_OPTIONAL_CONFIG_KEYS = frozenset({"is_weight_cap", "max_staleness", "policy_version"})
_SERVER_CONFIG_KEYS = frozenset({"current_policy_version"})


def parse_loss_config(spec: LossSpec, raw: Mapping[str, Any] | None) -> LossConfig:
    """Parse a request's `loss_fn_config` for the loss `spec` (from `spec_of`, resolved once per
    request by its caller); InvalidInput naming a bad key or value (field `loss_fn_config.<key>`).

    Proto maps carry every number as a double, so integral floats are accepted for the integer
    keys; JSON `null` unsets the optional keys.
    """
    loss_fn = spec.name
    if raw is None:
        return LossConfig()
    if not isinstance(raw, Mapping):
        raise InvalidInput(f"loss_fn_config must be an object, got {type(raw).__name__}", field="loss_fn_config")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key in _SERVER_CONFIG_KEYS:
            raise _config_error(str(key), "is set by the server and cannot be sent")
        if key not in CONFIG_KEYS:
            raise InvalidInput(f"unknown loss_fn_config key {key!r} for loss_fn {loss_fn!r}; "
                               f"allowed keys: {', '.join(CONFIG_KEYS)}", field=f"loss_fn_config.{key}")
        if value is None and key in _OPTIONAL_CONFIG_KEYS:
            continue
        if key in ("max_staleness", "policy_version") and isinstance(value, float) and value.is_integer():
            value = int(value)
        values[key] = value
    config = LossConfig(**values)
    if loss_fn == STABLE_REINFORCE and config.is_weight_cap is not None and config.is_weight_cap < 1:
        raise _config_error("is_weight_cap", f"must be >= 1 for {STABLE_REINFORCE} (the ratio is kept inside "
                                             f"[1/C, C]), got {config.is_weight_cap!r}")
    return config
