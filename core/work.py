"""The work contract: every item that crosses Redis from the API to a worker, one frozen type each.

    WorkItem(request_id, tenant_id, model_id, seq_id, kind, n_tokens, body)

    kind                        body            goes to
    create_model                CreateModel     trainer (seq_id 0; may load a checkpoint too)
    forward, forward_backward   PassWork        trainer, fused with other models' passes
    optim_step                  OptimStep       trainer, a barrier for its own model (AdamW or Dimuon)
    save_weights                SaveWeights     trainer (adapter + optimizer state)
    save_weights_for_sampler    SaveWeights     trainer (adapter only, tagged with its policy version)
    load_weights                LoadWeights     trainer
    rejected                    Rejected        trainer: a refused call passing in its seq_id's place
    sample                      SampleWork      generation pool (one GRPO group)

The API builds bodies only from validated input; workers trust them. Every type converts to and
from plain JSON explicitly (`to_json` / `from_json`), so what a worker reads is exactly what the
API wrote, and a malformed entry fails loudly in `WorkItem.from_fields` instead of deep in a worker.
Torch-free and I/O-free: the API, both workers, the simulator and the tests import it.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, TypeVar

from core.custom_loss import LossGraph
from core.errors import InvalidInput
from core.loss_spec import LossConfig

SEED_MAX = 2**63 - 1

# Optimizer families, each as the tinker SDK names it in an optimizer_config. A model's family is
# chosen at creation and kept for its life (the model's row, its checkpoints' metadata).
ADAMW = "adamw"
DIMUON = "dimuon"
OPTIMIZERS: dict[str, dict[str, Any]] = {ADAMW: {"type": ADAMW}, DIMUON: {"type": DIMUON, "version": 1}}
DIMUON_DAMPING = 0.1  # relative to the mean square: see batcher.engine.optimizers.step_dimuon


class WorkKind(StrEnum):
    CREATE_MODEL = "create_model"
    FORWARD = "forward"
    FORWARD_BACKWARD = "forward_backward"
    OPTIM_STEP = "optim_step"
    SAVE_WEIGHTS = "save_weights"
    SAVE_WEIGHTS_FOR_SAMPLER = "save_weights_for_sampler"
    SAVE_WEIGHTS_EXTERNAL = "save_weights_external"  # the adapter alone, for download
    LOAD_WEIGHTS = "load_weights"
    REJECTED = "rejected"
    SAMPLE = "sample"

    @property
    def is_pass(self) -> bool:
        """Runs in the fused forward/backward pass (everything else of a model is a barrier)."""
        return self in (WorkKind.FORWARD, WorkKind.FORWARD_BACKWARD)


# ----------------------------------------------------------------------------------- training


@dataclass(frozen=True)
class LoraShape:
    """A training model's LoRA: its rank, which module groups carry it, and the init seed."""

    rank: int
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> LoraShape:
        return cls(rank=int(obj["rank"]), seed=obj.get("seed"), train_attn=bool(obj.get("train_attn", True)),
                   train_mlp=bool(obj.get("train_mlp", True)), train_unembed=bool(obj.get("train_unembed", True)))


@dataclass(frozen=True)
class LoadWeights:
    """Load a training checkpoint: its files, whether the optimizer state comes along, and the
    tinker path the client named (echoed in the result)."""

    storage_path: str
    optimizer: bool
    path: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> LoadWeights:
        return cls(str(obj["storage_path"]), bool(obj["optimizer"]), str(obj["path"]))


@dataclass(frozen=True)
class CreateModel:
    lora: LoraShape
    load: LoadWeights | None = None  # create-from-checkpoint: the first request also loads its state
    optimizer: str = ADAMW  # the model's optimizer family (OPTIMIZERS), fixed for its life

    def to_json(self) -> dict[str, Any]:
        return {"lora": self.lora.to_json(), "load": self.load.to_json() if self.load else None,
                "optimizer": self.optimizer}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> CreateModel:
        load = obj.get("load")
        return cls(LoraShape.from_json(obj["lora"]), LoadWeights.from_json(load) if load else None,
                   str(obj.get("optimizer", ADAMW)))


@dataclass(frozen=True)
class ImageInput:
    """One image of a datum (a vision base): its checked bytes, and the run of `tokens` image tokens
    from `offset` on that stand for it (bases.vision). The trainer makes its pixels."""

    offset: int
    tokens: int
    format: str  # "png" or "jpeg"
    data: bytes

    def to_json(self) -> dict[str, Any]:
        return {"offset": self.offset, "tokens": self.tokens, "format": self.format,
                "data": base64.b64encode(self.data).decode("ascii")}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ImageInput:
        return cls(int(obj["offset"]), int(obj["tokens"]), str(obj["format"]), base64.b64decode(obj["data"]))


@dataclass(frozen=True)
class Datum:
    """One validated training example: model-input tokens and per-token loss inputs
    (`target_tokens` as ints, every other key as floats), all of the tokens' length."""

    tokens: tuple[int, ...]
    inputs: Mapping[str, tuple[float, ...] | tuple[int, ...]]
    policy_version: int | None = None  # the sampler's policy version, for staleness accounting
    # Targets per position: 1, or K for top-K distillation, where `target_tokens` and `weights` hold
    # len(tokens) * K values, row-major (core.loss_spec.WIDE_INPUTS).
    width: int = 1
    images: tuple[ImageInput, ...] = ()  # in token order; their tokens are the base's image token

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": list(self.tokens), "inputs": {k: list(v) for k, v in self.inputs.items()}}
        if self.policy_version is not None:
            out["policy_version"] = self.policy_version
        if self.width != 1:
            out["width"] = self.width
        if self.images:
            out["images"] = [image.to_json() for image in self.images]
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Datum:
        return cls(tuple(obj["tokens"]), {k: tuple(v) for k, v in obj["inputs"].items()}, obj.get("policy_version"),
                   obj.get("width", 1), tuple(ImageInput.from_json(i) for i in obj.get("images", ())))


@dataclass(frozen=True)
class PassWork:
    """A forward or forward_backward: which loss, its parsed config, and the data. Whether
    gradients are kept is the item's kind, never a field here."""

    loss_fn: str
    loss_config: LossConfig
    data: tuple[Datum, ...]
    # loss_fn "custom": the loss itself, so the trainer (and a replay after a crash) needs no store
    custom: LossGraph | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"loss_fn": self.loss_fn, "loss_config": self.loss_config.to_json(),
               "data": [d.to_json() for d in self.data]}
        if self.custom is not None:
            out["custom"] = self.custom.to_json()
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> PassWork:
        # A custom graph is checked again as it is read (core.custom_loss.parse).
        custom = LossGraph.from_json(obj["custom"]) if obj.get("custom") is not None else None
        return cls(obj["loss_fn"], LossConfig.from_json(obj["loss_config"]),
                   tuple(Datum.from_json(d) for d in obj["data"]), custom)


@dataclass(frozen=True)
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0: no clipping

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> AdamParams:
        return cls(**{k: float(v) for k, v in obj.items()})


@dataclass(frozen=True)
class DimuonParams:
    """One Dimuon step's hyperparameters (batcher.engine.optimizers.step_dimuon says what each does)."""

    learning_rate: float
    beta1: float = 0.9
    grad_clip_norm: float = 0.0  # nonpositive: no clipping
    damping: float = DIMUON_DAMPING
    rank_lr_correction_exponent: float = 0.0  # 0: no correction for the rank

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> DimuonParams:
        return cls(**{k: float(v) for k, v in obj.items()})


OptimParams = AdamParams | DimuonParams


def family_of(params: OptimParams) -> str:
    """The optimizer family a step's hyperparameters belong to."""
    return DIMUON if isinstance(params, DimuonParams) else ADAMW


_PARAMS_FIELD = {ADAMW: "adam_params", DIMUON: "optimizer_params"}  # where the tinker SDK sends each
_FAMILY_NAME = {ADAMW: "AdamW (AdamParams, sent as adam_params)", DIMUON: "Dimuon (DimuonParams, sent as optimizer_params)"}


def params_field(family: str) -> str:
    """The request field a family's step hyperparameters travel in."""
    return _PARAMS_FIELD[family]


def load_family(*, optimizer: bool, asked: str | None, saved: str | None, model: str | None) -> str:
    """The optimizer family of the model a load ends in, or a user error naming the field at fault.
    `optimizer`: the load takes the checkpoint's optimizer state too; `asked`: the request's
    optimizer_config (None: not sent); `saved`: the checkpoint's family (None: unknown here, the
    trainer checks it); `model`: the existing model loaded into (None: the load makes a new one).
    An existing model keeps its own, and refuses another family's state; a new model takes the
    checkpoint's with its state, else `asked` (AdamW when not sent)."""
    keeps = model if model is not None else saved if optimizer else None
    if keeps is not None and asked not in (None, keeps):
        why = "the model's, chosen at create_model" if model is not None else "the checkpoint's, whose state it loads"
        raise InvalidInput(f"optimizer_config {asked!r}: this load keeps {why} ({keeps!r}); leave optimizer_config out",
                           field="optimizer_config")
    if model is not None and optimizer and saved not in (None, model):
        raise InvalidInput(f"the checkpoint holds {saved} optimizer state and this model's optimizer is {model} (fixed "
                           f"at create_model): load its weights alone (load_state, optimizer=false), or load it with "
                           f"its state as a new model (create_training_client_from_state_with_optimizer)", field="path")
    return keeps or asked or ADAMW


def check_family(model_family: str, params_family: str) -> None:
    """A step's hyperparameters must be of the family the model was created with: a user error
    naming the field they came in otherwise."""
    if params_family != model_family:
        raise InvalidInput(f"this model's optimizer is {_FAMILY_NAME[model_family]}, chosen at create_model and kept "
                           f"for its life; send {_PARAMS_FIELD[model_family]}, not {params_family} parameters",
                           field=_PARAMS_FIELD[params_family])


@dataclass(frozen=True)
class OptimStep:
    params: OptimParams

    def to_json(self) -> dict[str, Any]:
        # AdamW's under "adam", as before there were families (replay logs keep old entries).
        return {"dimuon" if isinstance(self.params, DimuonParams) else "adam": self.params.to_json()}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> OptimStep:
        if "dimuon" in obj:
            return cls(DimuonParams.from_json(obj["dimuon"]))
        return cls(AdamParams.from_json(obj["adam"]))


@dataclass(frozen=True)
class SaveWeights:
    """A save (training checkpoint) or a publication for sampling (sampler weights): the
    checkpoint's name, the fresh version directory the API chose, and how long it lives."""

    name: str
    storage_path: str
    overwrite: bool
    ttl_s: int | None = None
    sliding: bool = False  # every use restarts the clock (anonymous sampler snapshots)
    sampling_session_id: str | None = None  # the anonymous form's sampler, echoed in the result
    user_metadata: dict[str, str] | None = None  # the client's, recorded with the checkpoint
    # An export encrypted to these age recipients (checkpoints.encryption); empty: plain files.
    age_recipients: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["age_recipients"] = list(self.age_recipients)
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> SaveWeights:
        return cls(str(obj["name"]), str(obj["storage_path"]), bool(obj["overwrite"]), obj.get("ttl_s"),
                   bool(obj.get("sliding", False)), obj.get("sampling_session_id"), obj.get("user_metadata"),
                   tuple(str(r) for r in obj.get("age_recipients") or ()))


@dataclass(frozen=True)
class Rejected:
    """A call the API refused for good, failing in its seq_id's place (api.seq_gaps)."""

    error: str
    field: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Rejected:
        return cls(str(obj["error"]), obj.get("field"))


# ----------------------------------------------------------------------------------- sampling


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling parameters in their one normalised form (gen_pool.params validates them)."""

    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1  # -1 = off
    top_p: float = 1.0
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    eos_stops: bool = True  # False when `stop` was given (including [])

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["stop_strings"], out["stop_token_ids"] = list(self.stop_strings), list(self.stop_token_ids)
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> SamplingSpec:
        return cls(**{**obj, "stop_strings": tuple(obj.get("stop_strings", ())),
                      "stop_token_ids": tuple(obj.get("stop_token_ids", ()))})

    def sample_seed(self, index: int) -> int | None:
        """The seed of the `index`-th sequence of a group: distinct per sequence, reproducible."""
        if self.seed is None:
            return None
        return (self.seed + 1_000_003 * index) % SEED_MAX


@dataclass(frozen=True)
class AdapterRef:
    """One published adapter version: what a sample request names."""

    key: str  # identity of the version (its immutable storage path)
    path: str
    model_id: str  # the training model it came from (tags every sequence)
    name: str = ""  # checkpoint name, for messages

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any] | None) -> AdapterRef | None:
        return cls(**obj) if obj else None


@dataclass(frozen=True)
class SampleWork:
    """One `sample(n)` request: a GRPO group of n sequences from one prompt."""

    prompt: tuple[int, ...]
    n: int
    spec: SamplingSpec
    adapter: AdapterRef | None  # None: the base model
    submitted_at: float
    deadline_at: float
    prompt_logprobs: bool = False
    prompt_logprobs_last_n: int | None = None
    prompt_topk: int = 0  # the k most likely tokens at every prompt position (0: none)
    sample_topk: int = 0  # the k most likely tokens at every sampled position (0: none)
    # Ids to score at prompt positions, as plain data (gen_pool.outputs.PromptTargets.to_json).
    prompt_targets: Mapping[str, Any] | None = None
    prompt_alt_k: int = 0  # draws from the next-token distribution at every prompt position (0: none)
    record_stability: bool = False  # keep each sequence's record for training requests (gen_pool.stability)
    stream: bool = False  # publish tokens as they are sampled (core.queue.delta_key), not only at the end
    episode_id: str | None = None  # the multi-turn episode it is a call of (gen_pool.episodes)
    episode_hint: str | None = None  # "promote" / "demote": the client's word on that episode
    images: tuple[ImageInput, ...] = ()  # a vision base's prompt images, their tokens in `prompt` (as a Datum's)

    def to_json(self) -> dict[str, Any]:
        out = self._fields()
        if self.images:
            out["images"] = [image.to_json() for image in self.images]
        return out

    def _fields(self) -> dict[str, Any]:
        return {"prompt": list(self.prompt), "n": self.n, "spec": self.spec.to_json(),
                "adapter": self.adapter.to_json() if self.adapter else None, "submitted_at": self.submitted_at,
                "deadline_at": self.deadline_at, "prompt_logprobs": self.prompt_logprobs,
                "prompt_logprobs_last_n": self.prompt_logprobs_last_n, "prompt_topk": self.prompt_topk,
                "sample_topk": self.sample_topk, "prompt_targets": self.prompt_targets,
                "prompt_alt_k": self.prompt_alt_k, "record_stability": self.record_stability,
                "stream": self.stream, "episode_id": self.episode_id, "episode_hint": self.episode_hint}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> SampleWork:
        return cls(tuple(obj["prompt"]), int(obj["n"]), SamplingSpec.from_json(obj["spec"]),
                   AdapterRef.from_json(obj.get("adapter")), float(obj["submitted_at"]), float(obj["deadline_at"]),
                   bool(obj.get("prompt_logprobs")), obj.get("prompt_logprobs_last_n"), int(obj.get("prompt_topk", 0)),
                   int(obj.get("sample_topk", 0)), obj.get("prompt_targets"), int(obj.get("prompt_alt_k", 0)),
                   bool(obj.get("record_stability", False)), bool(obj.get("stream", False)), obj.get("episode_id"),
                   obj.get("episode_hint"), tuple(ImageInput.from_json(i) for i in obj.get("images", ())))


# ----------------------------------------------------------------------------------- the item

Body = CreateModel | PassWork | OptimStep | SaveWeights | LoadWeights | Rejected | SampleWork

BODY_TYPES: Mapping[WorkKind, type[Any]] = {
    WorkKind.CREATE_MODEL: CreateModel,
    WorkKind.FORWARD: PassWork,
    WorkKind.FORWARD_BACKWARD: PassWork,
    WorkKind.OPTIM_STEP: OptimStep,
    WorkKind.SAVE_WEIGHTS: SaveWeights,
    WorkKind.SAVE_WEIGHTS_FOR_SAMPLER: SaveWeights,
    WorkKind.SAVE_WEIGHTS_EXTERNAL: SaveWeights,
    WorkKind.LOAD_WEIGHTS: LoadWeights,
    WorkKind.REJECTED: Rejected,
    WorkKind.SAMPLE: SampleWork,
}


B = TypeVar("B")


class MalformedWork(ValueError):
    """A stream entry that is not a work item this code can read."""


@dataclass(frozen=True)
class WorkItem:
    """One request for a worker: who, which model and position, what kind, and its typed body.
    For sampling, `model_id` is the sampler (or "") and `seq_id` the SDK's sequence (or 0)."""

    request_id: str
    tenant_id: str
    model_id: str
    seq_id: int
    kind: WorkKind
    n_tokens: int
    body: Body = field(repr=False)

    FIELD: ClassVar[str] = "item"

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", WorkKind(self.kind))  # a plain string is accepted, never kept
        expected = BODY_TYPES[self.kind]
        if not isinstance(self.body, expected):
            raise TypeError(f"a {self.kind} item carries a {expected.__name__}, not {type(self.body).__name__}")

    def body_as(self, kind: type[B]) -> B:
        """The body as the type its kind carries (a worker's handler for that kind asks for it)."""
        if not isinstance(self.body, kind):
            raise TypeError(f"a {self.kind} item carries a {type(self.body).__name__}, not {kind.__name__}")
        return self.body

    def to_fields(self) -> dict[str, str]:
        return {self.FIELD: json.dumps({"request_id": self.request_id, "tenant_id": self.tenant_id,
                                        "model_id": self.model_id, "seq_id": self.seq_id, "kind": str(self.kind),
                                        "n_tokens": self.n_tokens, "body": self.body.to_json()},
                                       separators=(",", ":"))}

    @classmethod
    def from_fields(cls, fields: Mapping[Any, Any]) -> WorkItem:
        raw: Any = fields.get(cls.FIELD.encode()) or fields.get(cls.FIELD)
        try:
            obj = json.loads(raw)
            kind = WorkKind(obj["kind"])
            return cls(str(obj["request_id"]), str(obj["tenant_id"]), str(obj["model_id"]), int(obj["seq_id"]),
                       kind, int(obj["n_tokens"]), BODY_TYPES[kind].from_json(obj["body"]))
        except (TypeError, ValueError, KeyError) as exc:
            raise MalformedWork(f"unreadable work item: {type(exc).__name__}: {exc}") from None
