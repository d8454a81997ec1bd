"""A refused training call still uses up its `seq_id`.

A model's requests run in `seq_id` order, and the tinker SDK gives every call the next id whatever
happened to the one before. So when the API refuses a call for good (a 4xx that retrying cannot
fix: bad input, a checkpoint that is not there, a budget reached), the trainer would otherwise wait
forever for that id and every later call of the model would hang. Instead the refusal is recorded
as a failed request at that `seq_id` and a placeholder (`WorkKind.REJECTED`) goes down the model's
stream; the trainer passes it in order, failing it with the same message, and bills nothing.

Refusals a client retries with the same id (408, 409, 425, 429), a body too large to read (413) and
a key that is not valid (401) leave the id free; so does anything refused before the caller and its
model are known (404 on the model, a body that cannot be parsed), where there is no model to wait.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Request

from api import admission
from core import ids
from core.errors import QuiltError
from core.work import Rejected, WorkItem, WorkKind
from tenancy.auth import Principal

log = logging.getLogger("quilt.api.seq_gaps")

# Route (endpoint function) name -> request kind, for the calls that carry a model's seq_id.
SEQUENCED_ROUTES = {
    "forward_backward": "forward_backward",
    "forward": "forward",
    "optim_step": "optim_step",
    "save_weights": "save_weights",
    "load_weights": "load_weights",
    "save_weights_for_sampler": "save_weights_for_sampler",
}
# Refusals that leave the seq_id free. The Quilt SDK reuses the id after exactly these
# (quilt.training.SEQ_FREE_STATUSES; tests/test_seq_gaps.py checks they agree).
SEQ_FREE_STATUSES = frozenset({401, 408, 409, 413, 425, 429})


def uses_up_seq(status_code: int) -> bool:
    """Whether a refusal with this status consumes the call's seq_id (pure)."""
    return 400 <= status_code < 500 and status_code not in SEQ_FREE_STATUSES


def claim(request: Request, model_id: str | None, seq_id: int | None) -> None:
    """Note which (model, seq_id) this call is, so a refusal further on can fill the gap."""
    if model_id is not None and seq_id is not None:
        request.state.seq_claim = (model_id, seq_id)


def claim_from_body(request: Request, body: Any) -> None:
    """The same, from a body that failed validation (only well-formed ids count)."""
    if isinstance(body, dict):
        model_id, seq_id = body.get("model_id"), body.get("seq_id")
        if isinstance(model_id, str) and len(model_id) <= 256 and type(seq_id) is int and 1 <= seq_id < 2**31:
            claim(request, model_id, seq_id)


async def fill(request: Request, err: QuiltError) -> None:
    """After refusing `request` with `err`: record the refusal at its seq_id and queue the
    placeholder, when the refusal is final and the call is a known model's. Never raises: the
    client gets its 4xx either way."""
    route = request.scope.get("route")
    kind = SEQUENCED_ROUTES.get(getattr(route, "name", ""))
    claimed = getattr(request.state, "seq_claim", None)
    who: Principal | None = getattr(request.state, "who", None)
    if kind is None or claimed is None or who is None or not uses_up_seq(err.status_code):
        return
    model_id, seq_id = claimed
    try:
        await _record(request, who, model_id, seq_id, kind, err)
    except Exception:
        log.exception("could not record the refused %s %s/%d", kind, model_id, seq_id)


async def _record(request: Request, who: Principal, model_id: str, seq_id: int, kind: str, err: QuiltError) -> None:
    pool, redis = request.app.state.pool, request.app.state.redis
    async with pool.connection() as conn:
        try:
            model = await admission.usable_model(conn, who, model_id, seq_id=seq_id)
        except QuiltError:  # not the caller's, or no longer usable: nothing waits on its seq_ids
            return
        if model["seq_holder_id"] is not None:
            return  # the id is in use already: there is no gap
        item = WorkItem(ids.new_request_id(), who.tenant_id, model_id, seq_id, WorkKind.REJECTED, 0,
                        Rejected(f"refused with HTTP {err.status_code}: {err.message}", err.field))
        request_id = await admission.admit(conn, redis, who, admission.Ticket(
            item, model["base_model"], admission.SeqSlot.of(model, seq_id), row_kind=kind, check_quota=False))
    log.info("refused %s %s/%d recorded as %s so later calls do not wait for it", kind, model_id, seq_id, request_id)
