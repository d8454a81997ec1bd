"""Request bodies, in the Tinker SDK's JSON shapes. Unknown fields are ignored (the SDK adds
fields over time); `type` literals are accepted but not required."""

from __future__ import annotations

import base64
import binascii
import json
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from api import provenance
from api.datums import RawDatum, RawImage, RawTensor
from checkpoints import retention
from core.errors import InvalidInput
from core.ids import check_name
from core.numbers import INT32_MAX, INT64_MAX
from core.queue import MAX_CLONE
from core.work import DIMUON_DAMPING, SEED_MAX

EPISODE_ID_PATTERN = r"^[A-Za-z0-9._:/-]{1,128}$"
# A checkpoint's user_metadata (tinker types it dict[str, str]), bounded so that its row stays small.
CheckpointMetadata = dict[Annotated[str, StringConstraints(max_length=128)],
                          Annotated[str, StringConstraints(max_length=1024)]]
CHECKPOINT_METADATA_ENTRIES = 64
# A session's or a model's user_metadata: free-form JSON, bounded as stored (its JSON text) so that
# no tenant fills rows, caches and listings with it.
USER_METADATA_BYTES = 16 * 1024


def _bounded_metadata(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value is not None:
        size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
        if size > USER_METADATA_BYTES:
            raise ValueError(f"is {size} bytes as JSON; the limit is {USER_METADATA_BYTES}")
    return value


UserMetadata = Annotated[dict[str, Any], AfterValidator(_bounded_metadata)]
Tag = Annotated[str, StringConstraints(max_length=128)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _check_name(value: str | None) -> str | None:
    return value if value is None else check_name(value, "checkpoint name")


class CreateSessionRequest(_Body):
    tags: list[Tag] = Field(default_factory=list, max_length=64)
    user_metadata: UserMetadata = Field(default_factory=dict)
    sdk_version: str | None = Field(None, max_length=64)
    display_name: str | None = Field(None, max_length=256)
    # The tinker SDK sends TINKER_PROJECT_ID here: a project of the caller's tenant (None: its default).
    project_id: str | None = Field(None, max_length=128)


class SessionHeartbeatRequest(_Body):
    session_id: str = Field(max_length=128)


class FinishSessionRequest(_Body):
    reason: dict[str, Any] = Field(default_factory=lambda: {"type": "success"})
    detail: str | None = None


class LoraConfig(_Body):
    rank: int = Field(ge=1, le=512)
    seed: int | None = Field(None, ge=0, le=SEED_MAX, description="adapter initialisation seed")
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True

    @model_validator(mode="after")
    def _something_trains(self) -> LoraConfig:
        if not (self.train_unembed or self.train_mlp or self.train_attn):
            raise ValueError("at least one of train_unembed, train_mlp, train_attn must be true")
        return self


class OptimizerConfig(_Body):
    """A training model's optimizer family, chosen at create_model and kept for its life (tinker's
    AdamOptimizerConfig, DimuonOptimizerConfig)."""

    type: Literal["adamw", "dimuon"] = "adamw"
    version: Literal[1] | None = Field(None, description="Dimuon's version (1, the one there is)")


class CreateModelRequest(_Body):
    session_id: str = Field(max_length=128)
    model_seq_id: int = Field(ge=0, le=1_000_000)
    base_model: str = Field(max_length=256)
    lora_config: LoraConfig
    optimizer_config: OptimizerConfig | None = Field(None, description="AdamW when left out")
    user_metadata: UserMetadata | None = None
    # Quilt's own (the tinker SDK sends none): the longest datum the model takes, up to what the base
    # and the trainer's memory plan allow (bases.memory_plan.model_context); left out, the standard
    # context (QUILT_STANDARD_CONTEXT_LENGTH) or the base's, whichever is shorter.
    max_context_length: int | None = Field(None, ge=1, le=2**31 - 1)


class ModelRef(_Body):
    model_id: str = Field(max_length=256)


class TensorDataIn(_Body):
    data: list[float | int]
    dtype: Literal["int64", "float32"] | None = None
    shape: list[int] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None

    @model_validator(mode="after")
    def _dense_only(self) -> TensorDataIn:
        if self.sparse_crow_indices is not None or self.sparse_col_indices is not None:
            raise ValueError("sparse tensors are not supported yet; send dense data")
        return self


class EncodedTextChunk(_Body):
    type: Literal["encoded_text"] = "encoded_text"
    tokens: list[int | float]


class ImageChunkIn(_Body):
    """An image's bytes (base64 in JSON), png or jpeg; it takes `expected_tokens` positions (api.images)."""

    type: Literal["image"]
    data: str
    format: str = Field(max_length=16)
    expected_tokens: int | None = Field(None, ge=0, le=1_000_000)

    def raw(self, at: int, field: str) -> RawImage:
        try:
            data = base64.b64decode(self.data, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidInput(f"{field}.data: not valid base64", field=f"{field}.data") from None
        return RawImage(at, self.format, data, expected_tokens=self.expected_tokens)


class ImageAssetPointerChunkIn(_Body):
    type: Literal["image_asset_pointer"]
    location: str = Field(max_length=8_000_000)
    format: str = Field(max_length=16)
    expected_tokens: int | None = Field(None, ge=0, le=1_000_000)

    def raw(self, at: int, field: str) -> RawImage:
        return RawImage(at, self.format, None, location=self.location, expected_tokens=self.expected_tokens)


class DmelChunkIn(_Body):
    """Audio: no base here takes it; refused by name rather than as an unknown chunk."""

    type: Literal["dmel"]
    dmel: Any = None

    @model_validator(mode="after")
    def _refuse(self) -> DmelChunkIn:
        raise ValueError("audio (dmel) chunks are not supported: no base model here takes audio")


Chunk = Annotated[EncodedTextChunk | ImageChunkIn | ImageAssetPointerChunkIn | DmelChunkIn, Field(discriminator="type")]


class ModelInputIn(_Body):
    chunks: list[Chunk] = Field(min_length=1)

    def parts(self, field: str) -> tuple[list[int | float], tuple[RawImage, ...]]:
        """Its text tokens and its images, each at its place among them."""
        tokens: list[int | float] = []
        images: list[RawImage] = []
        for k, chunk in enumerate(self.chunks):
            if isinstance(chunk, EncodedTextChunk):
                tokens += chunk.tokens
            else:
                assert not isinstance(chunk, DmelChunkIn)  # refused when parsed
                images.append(chunk.raw(len(tokens), f"{field}.chunks[{k}]"))
        return tokens, tuple(images)


class DatumIn(_Body):
    model_input: ModelInputIn
    loss_fn_inputs: dict[str, TensorDataIn | list[float | int]]
    policy_version: int | None = Field(None, ge=0, description="policy version the datum was sampled with")
    # tinker's provenance spans (which sampled sequence each token came from), in the protobuf's JSON
    # form: `{"sampled_tokens": {"sequence_id", "offset", "length"}}` or `{"prompt_tokens": {...}}`.
    # Checked for every loss; read by stable_reinforce (api.provenance).
    model_input_spans: list[dict[str, Any]] | None = Field(None, max_length=4096)
    loss_fn_input_spans: list[dict[str, Any]] | None = Field(None, max_length=4096)

    def raw(self, where: str = "model_input") -> RawDatum:
        tokens, images = self.model_input.parts(where)
        inputs = {
            k: RawTensor(v, "", None) if isinstance(v, list) else RawTensor(v.data, v.dtype or "", v.shape)
            for k, v in self.loss_fn_inputs.items()
        }
        datum = where.removesuffix(".model_input")
        model_spans, loss_spans = (None if raw is None else provenance.from_json(raw, f"{datum}.{name}")
                                   for name, raw in (("model_input_spans", self.model_input_spans),
                                                     ("loss_fn_input_spans", self.loss_fn_input_spans)))
        return RawDatum(tokens, inputs, self.policy_version, images,
                        provenance=provenance.pair(model_spans, loss_spans, datum))


class ForwardBackwardInput(_Body):
    data: list[DatumIn]
    loss_fn: str = Field(max_length=64)
    loss_fn_config: dict[str, Any] | None = None


class ForwardBackwardRequest(_Body):
    model_id: str = Field(max_length=256)
    seq_id: int = Field(ge=1, le=2**31 - 1)
    forward_backward_input: ForwardBackwardInput


class ForwardRequest(_Body):
    """POST /forward as tinker's ForwardRequest names it (`forward_input`). Quilt SDKs before 0.2
    sent `forward_backward_input` here, which is still read when `forward_input` is absent."""

    model_id: str = Field(max_length=256)
    seq_id: int = Field(ge=1, le=2**31 - 1)
    forward_input: ForwardBackwardInput


class AdamParams(_Body):
    learning_rate: float = Field(1e-4, ge=0, le=10, allow_inf_nan=False)
    beta1: float = Field(0.9, ge=0, lt=1, allow_inf_nan=False)
    beta2: float = Field(0.95, ge=0, lt=1, allow_inf_nan=False)
    eps: float = Field(1e-12, gt=0, le=1, allow_inf_nan=False)
    weight_decay: float = Field(0.0, ge=0, le=10, allow_inf_nan=False)
    grad_clip_norm: float = Field(0.0, ge=0, allow_inf_nan=False)


DIMUON_DAMPING_RANGE = (1e-6, 1e6)
DIMUON_EXPONENT_LIMIT = 4.0  # |rank_lr_correction_exponent|: (512 / 32) ** 4 is the largest correction


class DimuonParams(_Body):
    """One Dimuon step (tinker's DimuonParams; tinker 0.38 sends the first three, the rest take
    their defaults). What each does: docs/concepts/trainer.md."""

    type: Literal["dimuon"] = "dimuon"
    learning_rate: float = Field(ge=0, le=10, allow_inf_nan=False)
    grad_clip_norm: float = Field(0.0, allow_inf_nan=False, description="global gradient norm limit; nonpositive: none")
    beta1: float = Field(0.9, ge=0, lt=1, allow_inf_nan=False)
    damping: float = Field(DIMUON_DAMPING, ge=DIMUON_DAMPING_RANGE[0], le=DIMUON_DAMPING_RANGE[1], allow_inf_nan=False,
                           description="smooths the row and column preconditioner, relative to the mean square")
    rank_lr_correction_exponent: float = Field(0.0, ge=-DIMUON_EXPONENT_LIMIT, le=DIMUON_EXPONENT_LIMIT,
                                               allow_inf_nan=False,
                                               description="learning rate times (rank / 32) ** this; 0: none")


class OptimStepRequest(_Body):
    """The step's hyperparameters in the field of the model's optimizer family: `adam_params`
    (AdamW) or `optimizer_params` (Dimuon), as the tinker SDK sends them."""

    model_id: str = Field(max_length=256)
    seq_id: int = Field(ge=1, le=2**31 - 1)
    optimizer_params: DimuonParams | None = None
    adam_params: AdamParams | None = None


class SaveWeightsRequest(_Body):
    model_id: str = Field(max_length=256)
    seq_id: int = Field(ge=1, le=2**31 - 1)
    path: str = Field(description="checkpoint name, not a URI")
    overwrite: bool = False
    ttl_seconds: int | None = Field(None, ge=retention.MIN_TTL_S, le=retention.MAX_TTL_S,
                                    description="delete the checkpoint this long after the save; none: keep")
    user_metadata: CheckpointMetadata | None = Field(None, max_length=CHECKPOINT_METADATA_ENTRIES,
                                                     description="listed with the checkpoint")

    @field_validator("path")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_name(value, "checkpoint name")


class SaveWeightsExternalRequest(_Body):
    model_id: str = Field(max_length=256)
    seq_id: int = Field(ge=1, le=2**31 - 1)
    path: str = Field(description="checkpoint name, not a URI")
    ttl_seconds: int | None = Field(None, ge=retention.MIN_TTL_S, le=retention.MAX_TTL_S,
                                    description="delete the export this long after the save; none: keep")
    age_encryption_recipients: list[str] | None = Field(None, max_length=10)

    @field_validator("path")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_name(value, "checkpoint name")


class CheckpointTtlRequest(_Body):
    ttl_seconds: int | None = Field(..., ge=retention.MIN_TTL_S, le=retention.MAX_TTL_S,
                                    description="seconds from now until the checkpoint is deleted; null: never")


class LoadWeightsRequest(_Body):
    """Either into an existing model (`model_id`, `seq_id`) or, without them, as a new model's
    first request (`session_id`, `model_seq_id`: the tinker SDK's create-from-state)."""

    model_id: str | None = Field(None, max_length=256)
    seq_id: int | None = Field(None, ge=1, le=2**31 - 1)
    session_id: str | None = Field(None, max_length=128)
    model_seq_id: int | None = Field(None, ge=0, le=1_000_000)
    path: str = Field(max_length=1024)
    optimizer: bool = False
    user_metadata: UserMetadata | None = None
    base_model: str | None = Field(None, max_length=256, description="if given, the checkpoint's own base")
    optimizer_config: OptimizerConfig | None = Field(None, description="a new weights-only model's optimizer "
                                                     "(AdamW when left out); a full-state load keeps the checkpoint's")
    weights_access_token: str | None = Field(None, max_length=256, description="another tenant's grant to read "
                                             "the checkpoint (POST quilt/weights_access_tokens)")

    @model_validator(mode="after")
    def _one_addressing(self) -> LoadWeightsRequest:
        if self.model_id is not None:
            if self.seq_id is None:
                raise ValueError("seq_id is required with model_id")
        elif self.session_id is None or self.model_seq_id is None:
            raise ValueError("send model_id and seq_id, or session_id and model_seq_id to create a model from the checkpoint")
        return self


class CopyWeightsRequest(_Body):
    """tinker's CopyWeightsRequest: a destination project, or a session (and its model slot)."""

    source_path: str = Field(max_length=1024)
    destination_project_id: str | None = Field(None, max_length=128)
    session_id: str | None = Field(None, max_length=128)
    model_seq_id: int | None = Field(None, ge=0, le=1_000_000)
    ttl_seconds: int | None = Field(None, ge=retention.MIN_TTL_S, le=retention.MAX_TTL_S)
    weights_access_token: str | None = Field(None, max_length=256)

    @model_validator(mode="after")
    def _one_destination(self) -> CopyWeightsRequest:
        if self.session_id is not None:
            if self.model_seq_id is None:
                raise ValueError("model_seq_id is required with session_id")
            if self.destination_project_id is not None:
                raise ValueError("give destination_project_id or session_id, not both (a copy into a session "
                                 "lands in the session's project)")
        elif self.destination_project_id is None:
            raise ValueError("give destination_project_id, or session_id and model_seq_id")
        return self


class CreateProjectRequest(_Body):
    name: str = Field(min_length=1, max_length=128)

    @field_validator("name")
    @classmethod
    def _a_name(cls, value: str) -> str:
        return check_name(value, "project name")


class AssignProjectRequest(_Body):
    project_id: str = Field(min_length=1, max_length=128)


class SearchOwnerIn(_Body):
    """tinker's SearchOwner: `own`, `accessible`, or `user` with 1 to 10 `owner_urns` (`key:<prefix>`)."""

    type: Literal["own", "accessible", "user"] = "own"
    owner_urns: list[Annotated[str, StringConstraints(max_length=128)]] | None = Field(None, min_length=1, max_length=10)

    @model_validator(mode="after")
    def _urns_with_user(self) -> SearchOwnerIn:
        if (self.type == "user") != (self.owner_urns is not None):
            raise ValueError("owner_urns goes with type 'user', and only with it")
        return self


class StatusQueryIn(_Body):
    type: Literal["active", "cancelled", "failed", "client_finished"]
    reasons: list[Literal["success", "errored", "interrupted"]] | None = Field(None, min_length=1, max_length=3)


class SearchCursorIn(_Body):
    last_created_at: datetime
    last_session_id: str = Field(max_length=128)

    @field_validator("last_created_at")
    @classmethod
    def _aware(cls, value: datetime) -> datetime:
        if value.tzinfo is None:
            raise ValueError("must carry a time zone (pass a response's next_cursor back unchanged)")
        return value


class SessionSearchRequest(_Body):
    """tinker's SessionSearchRequest (RestClient.search_sessions)."""

    session_id: str | None = Field(None, max_length=128)
    project_ids: list[Annotated[str, StringConstraints(max_length=128)]] | None = Field(None, max_length=100)
    user_metadata: dict[Annotated[str, StringConstraints(max_length=128)],
                        Annotated[str, StringConstraints(max_length=1024)]] = Field(default_factory=dict, max_length=64)
    display_name: str | None = Field(None, min_length=1, max_length=256)
    owner: SearchOwnerIn = Field(default_factory=SearchOwnerIn)
    statuses: list[StatusQueryIn] | None = Field(None, min_length=1, max_length=16)
    limit: int = Field(50, ge=1, le=200)
    cursor: SearchCursorIn | None = None


class WeightsTokenRequest(_Body):
    """An access token to one of your checkpoints, for another tenant's copy_weights."""

    tinker_path: str = Field(max_length=1024)
    ttl_seconds: int | None = Field(None, ge=60, le=retention.MAX_TTL_S,
                                    description="seconds until the token stops working; null: until revoked")


class WeightsInfoRequest(_Body):
    tinker_path: str = Field(max_length=1024)


class RetrieveFutureRequest(_Body):
    request_id: str = Field(max_length=128)
    allow_metadata_only: bool = False


# --------------------------------------------------------------------------- sampling


class SaveWeightsForSamplerRequest(_Body):
    model_id: str = Field(max_length=256)
    seq_id: int = Field(ge=1, le=2**31 - 1)
    path: str | None = Field(None, description="checkpoint name (named form)")
    sampling_session_seq_id: int | None = Field(None, ge=0, le=2**31 - 1, description="anonymous form")
    kind: str | None = Field(None, max_length=32)
    ttl_seconds: int | None = Field(None, ge=retention.MIN_TTL_S, le=retention.MAX_TTL_S,
                                    description="delete the weights this long after the save; default: named "
                                                "kept, anonymous expire QUILT_ANON_SAMPLER_TTL_S after last use")
    user_metadata: CheckpointMetadata | None = Field(None, max_length=CHECKPOINT_METADATA_ENTRIES,
                                                     description="listed with the checkpoint")

    @field_validator("path")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        return _check_name(value)

    @model_validator(mode="after")
    def _one_form(self) -> SaveWeightsForSamplerRequest:
        if self.path is None and self.sampling_session_seq_id is None:
            raise ValueError("give either path (a checkpoint name) or sampling_session_seq_id")
        return self


class CreateCustomLossRequest(_Body):
    """tinker's CreateCustomLossRequest; `inputs` and `graph` are checked by `core.custom_loss.parse`,
    which names the node that breaks a rule."""

    session_id: str = Field(max_length=128)
    custom_loss_seq_id: int = Field(ge=0, le=2**31 - 1)
    name: str = Field(max_length=128)
    inputs: list[Any]
    graph: dict[str, Any]


class CreateSamplingSessionRequest(_Body):
    session_id: str = Field(max_length=128)
    sampling_session_seq_id: int = Field(ge=0, le=2**31 - 1)
    model_path: str | None = Field(None, max_length=1024)
    base_model: str | None = Field(None, max_length=256)

    @model_validator(mode="after")
    def _a_target(self) -> CreateSamplingSessionRequest:
        # Both may come (the tinker SDK sends both for a checkpoint): the weights decide, and a
        # base_model that is not theirs is refused (api.routes.sampling).
        if self.model_path is None and self.base_model is None:
            raise ValueError("give model_path (sampler weights) or base_model")
        return self


class SamplingParamsIn(_Body):
    max_tokens: int | None = Field(None, le=INT32_MAX)
    seed: int | None = None
    stop: str | list[int] | list[str] | None = None
    temperature: float = Field(1.0, allow_inf_nan=False)
    top_k: int = Field(-1, le=INT32_MAX)
    top_p: float = Field(1.0, allow_inf_nan=False)


class SampleRequest(_Body):
    sampling_session_id: str | None = Field(None, max_length=256)
    # The SDK's sampling ids exceed int32: a clone's are clone * 10^9 + n (core.queue.CLONE_SPAN).
    seq_id: int | None = Field(None, ge=0, le=INT64_MAX)
    base_model: str | None = Field(None, max_length=256)
    model_path: str | None = Field(None, max_length=1024)
    num_samples: int = Field(1, ge=1, le=INT32_MAX)
    prompt: ModelInputIn
    sampling_params: SamplingParamsIn = Field(default_factory=SamplingParamsIn)
    prompt_logprobs: bool = False
    prompt_logprobs_last_n: int | None = Field(None, ge=0, le=INT32_MAX)
    topk_prompt_logprobs: int = Field(0, le=INT32_MAX)
    topk_sample_logprobs: int = Field(0, le=INT32_MAX)
    prompt_alt_tokens_k: int = Field(0, le=INT32_MAX)
    # tinker TensorData as JSON, checked against the prompt by gen_pool.outputs.parse_targets.
    target_prompt_logprobs: dict | None = None
    record_stability_info: bool | None = None
    deadline_s: float | None = Field(None, gt=0, allow_inf_nan=False,
                                     description="Quilt: abort and fail the request if unfinished after this")
    episode_id: str | None = Field(None, pattern=EPISODE_ID_PATTERN,
                                   description="Quilt: the multi-turn episode this call belongs to (1-128 of "
                                               "letters, digits, '.', '_', ':', '/', '-'); the pool serves episodes "
                                               "that have consumed less first")
    episode_hint: Literal["promote", "demote"] | None = Field(
        None, description="Quilt: move the episode one feedback level up (say its tool returned the final answer) "
                          "or down (say a retry loop began); needs episode_id")

    @model_validator(mode="after")
    def _hint_needs_episode(self) -> SampleRequest:
        if self.episode_hint is not None and self.episode_id is None:
            raise ValueError("episode_hint needs episode_id")
        return self


class SamplingSessionTarget(_Body):
    type: Literal["sampling_session"] = "sampling_session"
    sampling_session_id: str = Field(max_length=256)
    cloned_sampler_id: int = Field(0, ge=0, le=MAX_CLONE)


class RetrieveFuturesRequest(_Body):
    target: SamplingSessionTarget
    prev_cursor: int = Field(0, ge=0, le=INT64_MAX)
    timeout: float | None = Field(None, ge=0, allow_inf_nan=False, description="seconds; at most the server's hold")
    # Results the client has read for good: deleted rather than kept for QUILT_FUTURE_TTL_SECONDS.
    retrieved_request_ids: list[Annotated[str, Field(max_length=128)]] = Field(default_factory=list,
                                                                               max_length=10_000)


class JoinSamplingSessionRequest(_Body):
    sampling_session_id: str = Field(max_length=256)


class CancelFutureRequest(_Body):
    request_id: str = Field(max_length=128)
