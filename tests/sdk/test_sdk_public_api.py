"""The public surface is pinned: changing it must be a deliberate edit of this test."""

import inspect

import quilt

EXPECTED = {
    "__version__",
    "Client", "TrainingClient", "SamplingClient", "APIFuture",
    "SamplingParams", "SampledSequence", "SampleResponse",
    "TensorData", "EncodedTextChunk", "ModelInput", "Datum", "AdamParams",
    "ForwardBackwardOutput", "OptimStepResult", "TrainStepResult", "datum_for_next_token",
    "CostEstimate", "UsageReport",
    "progress",
    "QuiltError", "ConfigurationError", "APIConnectionError", "APITimeoutError",
    "APIResponseError", "APIStatusError", "BadRequestError", "AuthenticationError",
    "BudgetExceededError", "PermissionDeniedError", "NotFoundError", "RateLimitError",
    "InternalServerError", "RequestFailedError", "UserRequestError", "ServerRequestError",
}


def test_all_is_pinned():
    assert sorted(quilt.__all__) == sorted(EXPECTED)
    assert len(quilt.__all__) == len(set(quilt.__all__))


def test_every_name_in_all_exists():
    for name in quilt.__all__:
        assert hasattr(quilt, name), name


def test_public_callables_have_docstrings():
    for name in quilt.__all__:
        obj = getattr(quilt, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert inspect.getdoc(obj), name
            for attr, member in vars(obj).items():
                if inspect.isfunction(member) and not attr.startswith("_"):
                    assert inspect.getdoc(member), f"{name}.{attr}"


def test_client_signature():
    params = inspect.signature(quilt.Client).parameters
    assert list(params) == ["api_key", "base_url", "timeout", "transport"]
    assert params["timeout"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["timeout"].default == 60.0
