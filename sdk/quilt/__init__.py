"""Quilt: Python client for the Quilt LoRA training service.

Quick start::

    import quilt

    with quilt.Client() as client:                      # QUILT_API_KEY, QUILT_BASE_URL
        tc = client.create_training_client("Qwen/Qwen3-0.6B", rank=16)
        datum = quilt.datum_for_next_token([1, 2, 3, 4])
        for _ in quilt.progress(range(10), desc="train"):
            result = tc.train_step([datum], adam=quilt.AdamParams(learning_rate=1e-4))
        print(result.loss, tc.save_state("final").result())
        sampler = tc.save_weights_and_get_sampling_client()   # a snapshot of these weights
        group = sampler.sample([1, 2, 3], 4, quilt.SamplingParams(max_tokens=8)).result()
        print([s.tokens for s in group.sequences], group.sequences[0].policy_version)

Every network call runs on one background event loop; each blocking method has an ``*_async``
twin, and futures can be ``await``-ed or ``.result()``-ed.
"""

import logging

from ._version import __version__
from .billing import CostEstimate, UsageReport
from .client import Client
from .errors import (
    APIConnectionError,
    APIResponseError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    BudgetExceededError,
    ConfigurationError,
    InternalServerError,
    NotFoundError,
    PermissionDeniedError,
    QuiltError,
    RateLimitError,
    RequestFailedError,
    ServerRequestError,
    UserRequestError,
)
from .futures import APIFuture
from .progress import progress
from .sampling import SampledSequence, SampleResponse, SamplingClient, SamplingParams
from .training import TrainingClient
from .types import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    ModelInput,
    OptimStepResult,
    TensorData,
    TrainStepResult,
    datum_for_next_token,
)

# A library must not configure logging; this only silences "no handler" warnings.
logging.getLogger("quilt").addHandler(logging.NullHandler())

__all__ = [
    "__version__",
    # clients and futures
    "Client",
    "TrainingClient",
    "SamplingClient",
    "APIFuture",
    # data types
    "TensorData",
    "EncodedTextChunk",
    "ModelInput",
    "Datum",
    "AdamParams",
    "ForwardBackwardOutput",
    "OptimStepResult",
    "TrainStepResult",
    "datum_for_next_token",
    "SamplingParams",
    "SampledSequence",
    "SampleResponse",
    # cost
    "CostEstimate",
    "UsageReport",
    # helpers
    "progress",
    # errors
    "QuiltError",
    "ConfigurationError",
    "APIConnectionError",
    "APITimeoutError",
    "APIResponseError",
    "APIStatusError",
    "BadRequestError",
    "AuthenticationError",
    "BudgetExceededError",
    "PermissionDeniedError",
    "NotFoundError",
    "RateLimitError",
    "InternalServerError",
    "RequestFailedError",
    "UserRequestError",
    "ServerRequestError",
]
