"""Property tests of the two parsers every training body goes through: the tinker protobuf
decoder and the datum validator. Whatever bytes or values arrive, the answer is the work or an
`InvalidInput` naming a field; and what passes is what the trainer can hold (token ids in the
vocabulary, per-token values finite in float32)."""

from __future__ import annotations

import math

import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api import datums, input_guard, tinker_proto
from api.datums import RawDatum, RawTensor
from core.errors import InvalidInput
from core.loss_spec import spec_of
from core.numbers import FLOAT32_MAX
from tests.fuzz.protobuf_bodies import bodies, messages

LIMITS = datums.Limits(vocab_size=1024, max_context_length=64, max_datums=8, max_tokens=256)
SETTINGS = settings(max_examples=400, derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


def _checked_work(parsed: tinker_proto.ForwardBackwardProto):
    try:
        work, n_tokens = datums.pass_work(spec_of(parsed.loss_fn), parsed.loss_fn_config, parsed.data, LIMITS)
    except InvalidInput as exc:
        assert exc.field, exc
        return
    _assert_holdable(work.data)
    assert n_tokens == sum(len(d.tokens) for d in work.data) <= LIMITS.max_tokens


def _assert_holdable(data) -> None:
    for d in data:
        assert all(isinstance(t, int) and 0 <= t < LIMITS.vocab_size for t in d.tokens)
        for key, values in d.inputs.items():
            assert len(values) == len(d.tokens)
            if key == "target_tokens":
                assert all(isinstance(t, int) and 0 <= t < LIMITS.vocab_size for t in values)
            else:
                assert all(isinstance(v, float) and math.isfinite(v) and abs(v) <= FLOAT32_MAX for v in values)


@SETTINGS
@given(body=bodies())
def test_the_protobuf_decoder_answers_the_request_or_a_field_error(body):
    try:
        parsed = tinker_proto.decode_forward_backward(body, max_sparse_values=1 << 22)
    except InvalidInput as exc:
        assert exc.field, exc
        return
    _checked_work(parsed)


@SETTINGS
@given(body=messages())
def test_well_formed_messages_decode_then_validate_cleanly(body):
    _test = test_the_protobuf_decoder_answers_the_request_or_a_field_error
    _test.hypothesis.inner_test(body)  # the same property on well-formed messages only, more of them


def test_a_zstd_frame_is_not_mistaken_for_a_message():
    # Decompression is the body limit's job (api.body_limit); the decoder sees plain bytes only.
    frame = zstandard.ZstdCompressor().compress(b"\x0a\x01m")
    try:
        tinker_proto.decode_forward_backward(frame, max_sparse_values=1 << 22)
    except InvalidInput:
        pass


_SCALARS = st.one_of(st.integers(-(2**80), 2**80), st.floats(allow_nan=True, allow_infinity=True),
                     st.booleans(), st.none(), st.text(max_size=3))
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3), max_leaves=6)


@st.composite
def raw_datums(draw) -> RawDatum:
    n = draw(st.integers(0, 12))
    tokens = draw(st.lists(st.one_of(st.integers(-5, 1030), _SCALARS), min_size=n, max_size=n))
    inputs = {}
    for key in draw(st.lists(st.sampled_from(["target_tokens", "weights", "logprobs", "advantages", "mask", ""]),
                             max_size=4, unique=True)):
        size = draw(st.sampled_from([n, n + 1, 0]))
        data = draw(st.lists(st.one_of(st.integers(-5, 1030), st.floats(width=64), _VALUES), min_size=size,
                             max_size=size))
        shape = draw(st.one_of(st.none(), st.lists(st.integers(-1, 2**63), max_size=2)))
        inputs[key] = RawTensor(data, draw(st.sampled_from(["", "int64", "float32", "bf16"])), shape)
    version = draw(st.one_of(st.none(), st.integers(-1, 2**70)))
    return RawDatum(tokens, inputs, version)


@SETTINGS
@given(data=st.lists(raw_datums(), max_size=4),
       loss_fn=st.sampled_from(["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "nope"]),
       config=st.one_of(st.none(), st.dictionaries(st.sampled_from(["clip_low_threshold", "clip_high_threshold",
                                                                    "beta", "max_staleness", "?"]), _VALUES,
                                                   max_size=3)))
def test_the_datum_validator_answers_work_the_trainer_can_hold_or_a_field_error(data, loss_fn, config):
    try:
        work, _ = datums.pass_work(spec_of(loss_fn), config, data, LIMITS)
    except InvalidInput as exc:
        assert exc.field, exc
        return
    _assert_holdable(work.data)


@SETTINGS
@given(value=st.recursive(st.one_of(_SCALARS, st.text()), lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)), max_leaves=20))
def test_the_input_guard_refuses_exactly_unstorable_text(value):
    def bad_text(v) -> bool:
        if isinstance(v, str):
            return input_guard.text_problem(v) is not None
        if isinstance(v, list):
            return any(bad_text(x) for x in v)
        if isinstance(v, dict):
            return any(bad_text(k) or bad_text(x) for k, x in v.items())
        return False

    try:
        input_guard.check_value(value)
    except InvalidInput:
        assert bad_text(value)
        return
    assert not bad_text(value)
