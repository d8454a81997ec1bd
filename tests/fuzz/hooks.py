"""Schemathesis hooks for `tests/test_fuzz_edge.py` (loaded with SCHEMATHESIS_HOOKS).

Random ids only ever reach a 404, so half of the generated requests carry the fuzz tenant's real
ids (from QUILT_FUZZ_IDS, a JSON object of field name -> id): the hostile values then reach the
model, checkpoint and sampler code behind the lookups. Protobuf bodies come from
`tests.fuzz.protobuf_bodies`."""

from __future__ import annotations

import json
import os

import schemathesis
from hypothesis import strategies as st

from tests.fuzz.protobuf_bodies import bodies

schemathesis.openapi.media_type("application/x-protobuf", bodies())

REAL_IDS: dict[str, str] = json.loads(os.environ.get("QUILT_FUZZ_IDS") or "{}")


def _with_real_ids(value):
    if not isinstance(value, dict):
        return st.just(value)
    keys = [k for k in REAL_IDS if k in value]
    if not keys:
        return st.just(value)
    return st.booleans().map(lambda real: {**value, **{k: REAL_IDS[k] for k in keys}} if real else value)


@schemathesis.hook
def flatmap_body(ctx, body):
    return _with_real_ids(body)


@schemathesis.hook
def flatmap_path_parameters(ctx, path_parameters):
    return _with_real_ids(path_parameters)
