"""Hypothesis strategies for `tinker_public.ForwardBackwardRequest` bodies: well-formed messages
with hostile values (token bytes of any length, every dtype number, NaN/Inf, huge shapes and
configs), plus raw bytes and zstd frames of either. Used by the schemathesis run (as the
strategy for `application/x-protobuf`) and by the decoder's own property test."""

from __future__ import annotations

import struct

import zstandard
from hypothesis import strategies as st

FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=64)
_INT32 = st.integers(-(2**31), 2**31 - 1)


def _pb():
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


@st.composite
def _tensor(draw, pb, tensor):
    dtype = draw(st.sampled_from([pb.DTYPE_FLOAT32, pb.DTYPE_INT64, pb.DTYPE_INT32, 0, 7]))
    tensor.dtype = dtype
    if draw(st.booleans()):
        n = draw(st.integers(0, 40))
        if dtype == pb.DTYPE_FLOAT32:
            tensor.dense = struct.pack(f"<{n}f", *draw(st.lists(st.floats(width=32), min_size=n, max_size=n)))
        else:
            tensor.dense = struct.pack(f"<{n}q", *draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=n,
                                                               max_size=n)))
        tensor.dense += draw(st.binary(max_size=3))
    else:
        tensor.dense = draw(st.binary(max_size=64))
    tensor.shape.extend(draw(st.lists(st.integers(0, 2**63 - 1), max_size=2)))


@st.composite
def messages(draw) -> bytes:
    pb = _pb()
    msg = pb.ForwardBackwardRequest()
    msg.model_id = draw(st.text(st.characters(exclude_categories=["Cs"]), max_size=40))  # proto strings are UTF-8
    msg.seq_id = draw(_INT32)
    msg.loss_fn = draw(st.sampled_from(["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "", "x" * 70]))
    msg.forward_only = draw(st.booleans())
    for key in draw(st.lists(st.sampled_from(["clip_low_threshold", "clip_high_threshold", "beta", "\x00"]),
                             max_size=3)):
        msg.loss_fn_config[key] = draw(FLOATS)
    for _ in range(draw(st.integers(0, 3))):
        d = msg.data.add()
        for _ in range(draw(st.integers(0, 2))):
            chunk = d.model_input.add()
            if draw(st.booleans()):
                tokens = draw(st.lists(_INT32, max_size=24))
                chunk.encoded_text.tokens = struct.pack(f"<{len(tokens)}i", *tokens) + draw(st.binary(max_size=3))
            else:
                chunk.encoded_text.tokens = draw(st.binary(max_size=20))
        for name in draw(st.lists(st.sampled_from(["target_tokens", "weights", "logprobs", "advantages", "\x00"]),
                                  max_size=4, unique=True)):
            draw(_tensor(pb, d.loss_fn_inputs[name]))
    return msg.SerializeToString()


def bodies() -> st.SearchStrategy[bytes]:
    """Messages and garbage, each plain or zstd-compressed."""
    raw = st.one_of(messages(), st.binary(max_size=256))
    return st.one_of(raw, raw.map(lambda b: zstandard.ZstdCompressor().compress(b)))
