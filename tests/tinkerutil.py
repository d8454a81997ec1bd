"""What the official-SDK tests need to run unchanged on every tinker release they cover."""

from __future__ import annotations

import tinker
from tinker import types
from tinker.lib.public_interfaces.rest_client import RestClient


def rest_client(stack, key: str) -> RestClient:
    """`tinker.RestClient` (0.38), or a ServiceClient's, the only way in 0.34."""
    if hasattr(tinker, "RestClient"):
        return tinker.RestClient(base_url=stack.base_url, api_key=key)
    return tinker.ServiceClient(base_url=stack.base_url, api_key=key).create_rest_client()


def ready(made):
    """A client from a creation call: 0.38 returns a future of it, 0.34 the client itself."""
    return made.result() if hasattr(made, "result") else made


def sft_data() -> list[types.Datum]:
    """Four 16-token rows of consecutive ids: a task the tiny base learns in a few steps."""
    out = []
    for start in (40, 80, 120, 160):
        toks = list(range(start, start + 17))
        out.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                               loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 16}))
    return out
