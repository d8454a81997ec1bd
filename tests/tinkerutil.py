"""What the official-SDK tests need to run unchanged on every tinker release they cover."""

from __future__ import annotations

import tinker
from tinker.lib.public_interfaces.rest_client import RestClient


def rest_client(stack, key: str) -> RestClient:
    """`tinker.RestClient` (0.38), or a ServiceClient's, the only way in 0.34."""
    if hasattr(tinker, "RestClient"):
        return tinker.RestClient(base_url=stack.base_url, api_key=key)
    return tinker.ServiceClient(base_url=stack.base_url, api_key=key).create_rest_client()


def ready(made):
    """A client from a creation call: 0.38 returns a future of it, 0.34 the client itself."""
    return made.result() if hasattr(made, "result") else made
