"""The framework's floor for bench/api_load.py: a FastAPI app that answers the calls the bench makes
with a constant, served by the same uvicorn (uvloop, httptools, no access log) as Quilt's API.

Its requests per CPU-second, measured beside Quilt's in the same run, is what FastAPI and uvicorn
alone cost per call on this host at this hour: Quilt's figure over it is the share of a call's CPU
that is the framework's, a ratio that a host running at half speed leaves in place.

    uvicorn --factory framework_floor:create_app   (PYTHONPATH=bench)
"""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict


class Call(BaseModel):
    """Any of the bench's bodies: validated as a model, as Quilt's routes validate theirs."""

    model_config = ConfigDict(extra="allow")
    model_id: str | None = None
    request_id: str | None = None


def create_app() -> FastAPI:
    app = FastAPI()

    @app.post("/api/v1/{name}")
    async def answer(name: str, body: Call) -> dict:
        return {"type": name, "model_id": body.model_id, "request_id": body.request_id}

    return app
