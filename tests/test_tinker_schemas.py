"""Every JSON request body Quilt accepts, field by field against the tinker SDK's own request
types: each field tinker sends is one Quilt reads (honoured, or refused with a 400 naming it),
never one a body model drops unread (they ignore unknown fields). Quilt's own additions are
named here too, so a new field on either side fails until it is placed."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import tinker.types as tinker_types

from api import schemas

# tinker's request type -> the Quilt body model of the same route (or of the same nested object).
PAIRS = {
    "CreateSessionRequest": schemas.CreateSessionRequest,
    "SessionHeartbeatRequest": schemas.SessionHeartbeatRequest,
    "CreateModelRequest": schemas.CreateModelRequest,
    "GetInfoRequest": schemas.ModelRef,
    "ForwardBackwardRequest": schemas.ForwardBackwardRequest,
    "ForwardRequest": schemas.ForwardRequest,
    "OptimStepRequest": schemas.OptimStepRequest,
    "SaveWeightsRequest": schemas.SaveWeightsRequest,
    "SaveWeightsForSamplerRequest": schemas.SaveWeightsForSamplerRequest,
    "SaveWeightsExternalRequest": schemas.SaveWeightsExternalRequest,
    "LoadWeightsRequest": schemas.LoadWeightsRequest,
    "CreateSamplingSessionRequest": schemas.CreateSamplingSessionRequest,
    "CreateCustomLossRequest": schemas.CreateCustomLossRequest,
    "JoinSamplingSessionRequest": schemas.JoinSamplingSessionRequest,
    "SampleRequest": schemas.SampleRequest,
    "FutureRetrieveRequest": schemas.RetrieveFutureRequest,
    "FuturesRetrieveRequest": schemas.RetrieveFuturesRequest,
    "CopyWeightsRequest": schemas.CopyWeightsRequest,
    "SessionSearchRequest": schemas.SessionSearchRequest,
    # nested objects
    "ForwardBackwardInput": schemas.ForwardBackwardInput,
    "Datum": schemas.DatumIn,
    "ModelInput": schemas.ModelInputIn,
    "EncodedTextChunk": schemas.EncodedTextChunk,
    "TensorData": schemas.TensorDataIn,
    "LoraConfig": schemas.LoraConfig,
    "AdamParams": schemas.AdamParams,
    "SamplingParams": schemas.SamplingParamsIn,
}

# tinker request types with no JSON body model here, and why.
NOT_SERVED = {
    "ClientConfigRequest": "answered without reading a body (api.routes.service: the handshake's flags are the server's)",
    "GetBillingUsageRequest": "a GET: its fields are query parameters of billing/usage/events",
    "GetCurrentCheckpointStorageUsageRequest": "a GET of billing/usage/checkpoints/current; a tenant has no projects",
    "TelemetrySendRequest": "telemetry is not collected (the SDK's telemetry is off against Quilt: client/config)",
    "UnloadModelRequest": "adapters are parked by the trainer itself (QUILT_TRAINER_OFFLOAD_IDLE_S)",
}

# Quilt's own fields beyond tinker's, per body model, and why.
QUILT_ONLY = {
    ("SampleRequest", "deadline_s"): "Quilt: abort a request unfinished after this",
    ("SampleRequest", "episode_id"): "Quilt: multi-turn episodes (gen_pool.episodes)",
    ("SampleRequest", "episode_hint"): "Quilt: multi-turn episodes",
    ("Datum", "policy_version"): "Quilt: the policy version a datum was sampled with (staleness)",
    ("TensorData", "data"): "tinker's TensorData keeps its values in data on the wire",
    ("EncodedTextChunk", "type"): "the chunk's discriminator, as tinker sends it",
    ("CreateModelRequest", "max_context_length"): "Quilt: the model's context, which the price book may tier",
}


def _tinker_fields(name: str) -> list[set[str]]:
    """The fields of tinker's type `name` as they may travel: one set of names per field (a field
    with aliases, such as OptimStepRequest's optim_params sent as adam_params or optimizer_params,
    travels under any one of them); private fields and the `type` discriminator left out."""
    cls = getattr(tinker_types, name)
    if hasattr(cls, "model_fields"):
        groups = []
        for field_name, field in cls.model_fields.items():
            choices = getattr(field.validation_alias, "choices", None)
            groups.append(set(choices) if choices else {field.alias or field_name})
    elif dataclasses.is_dataclass(cls):
        groups = [{f.name} for f in dataclasses.fields(cls)]
    else:
        groups = [{f} for f in typing.get_type_hints(cls)]
    return [g for g in groups if not any(f.startswith("_") or f == "type" for f in g)]


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_quilt_reads_every_field_tinker_sends(name):
    quilt = set(PAIRS[name].model_fields)
    dropped = [sorted(g) for g in _tinker_fields(name) if not g & quilt]
    assert dropped == [], f"{name}: tinker sends {dropped}, which Quilt would drop unread"


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_quilts_own_fields_are_named(name):
    sent = set().union(*_tinker_fields(name))
    extra = set(PAIRS[name].model_fields) - sent - {"type"}
    assert {f for f in extra if (name, f) not in QUILT_ONLY} == set()


def test_every_tinker_request_type_is_placed():
    names = {n for n in dir(tinker_types) if n.endswith("Request")}
    assert names - set(PAIRS) - set(NOT_SERVED) == set()


@pytest.mark.parametrize(("model", "body", "field"), [
    (schemas.CopyWeightsRequest, {"source_path": "tinker://r/weights/a"}, "destination_project_id"),
    (schemas.CopyWeightsRequest, {"source_path": "tinker://r/weights/a", "session_id": "s"}, "model_seq_id"),
    (schemas.OptimStepRequest, {"model_id": "m", "seq_id": 1, "optimizer_params": {"type": "dimuon"}},
     "optimizer_params"),
    (schemas.CreateSamplingSessionRequest, {"session_id": "s", "sampling_session_seq_id": 0}, None),
])
def test_fields_quilt_cannot_honour_are_refused_by_name(model, body, field):
    with pytest.raises(Exception) as err:
        model.model_validate(body)
    assert field is None or field in str(err.value)


def test_a_sampler_may_name_its_weights_and_their_base():
    both = schemas.CreateSamplingSessionRequest.model_validate(
        {"session_id": "s", "sampling_session_seq_id": 0, "model_path": "tinker://m/sampler_weights/a",
         "base_model": "quilt/tiny-qwen3"})
    assert (both.model_path, both.base_model) == ("tinker://m/sampler_weights/a", "quilt/tiny-qwen3")
