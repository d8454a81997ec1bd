"""Top-K targets of cross_entropy (tinker's soft targets, what off-policy distillation sends):
`target_tokens` and `weights` of shape (N, K), dense or sparse CSR, checked at the API and summed
over the K candidates by the trainer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from api import tinker_proto
from api.datums import Limits, RawDatum, RawTensor, normalise
from batcher.engine.backend import LoraBackend
from batcher.engine.protocol import PassRequest
from core.errors import InvalidInput
from core.loss_spec import MAX_TARGET_WIDTH, LossConfig, spec_of
from core.work import Datum, LoraShape, PassWork
from stack.tiny_model import build_tiny_model

LIMITS = Limits(vocab_size=1000, max_context_length=64, max_datums=8, max_tokens=256)


def raw(n: int, k: int, *, weights_shape=None, extra=None) -> RawDatum:
    targets = RawTensor([(7 * i) % 1000 for i in range(n * k)], "int64", [n, k])
    weights = RawTensor([1.0 / k] * n * (weights_shape or [n, k])[-1] if len(weights_shape or [n, k]) == 2 else [1.0] * n,
                        "float32", weights_shape or [n, k])
    return RawDatum(list(range(1, n + 1)), {"target_tokens": targets, "weights": weights, **(extra or {})})


def test_two_d_targets_become_a_datum_of_that_width():
    (datum,), tokens = normalise([raw(5, 3)], spec_of("cross_entropy"), LIMITS)
    assert datum.width == 3 and len(datum.inputs["target_tokens"]) == 15 and tokens == 5
    assert Datum.from_json(datum.to_json()) == datum


@pytest.mark.parametrize(("data", "loss_fn", "field", "words"), [
    ([raw(5, 3)], "importance_sampling", "data[0].loss_fn_inputs.target_tokens", "is not accepted"),
    ([raw(5, 3, weights_shape=[5])], "cross_entropy", "data[0].loss_fn_inputs.weights", "same shape"),
    ([RawDatum([1, 2], {"target_tokens": RawTensor([1, 2, 3, 4], "int64", [2, 2])})], "cross_entropy",
     "data[0].loss_fn_inputs.weights", "need weights"),
    ([raw(5, MAX_TARGET_WIDTH + 1)], "cross_entropy", "data[0].loss_fn_inputs.target_tokens", "the limit is"),
    ([raw(4, 2)], "cross_entropy", None, None),
    ([raw(5, 2), raw(5, 3)], "cross_entropy", "data[1].loss_fn_inputs.target_tokens", "every datum"),
    ([raw(5, 2, extra={"logprobs": RawTensor([0.0] * 5, "float32", [5])})], "cross_entropy",
     "data[0].loss_fn_inputs.logprobs", "sampler logprobs"),
    ([RawDatum([1, 2], {"target_tokens": RawTensor([1, 2, 3, 4], "int64", [2, 1, 2])})], "cross_entropy",
     "data[0].loss_fn_inputs.target_tokens", "is not accepted"),
    ([RawDatum([1, 2, 3], {"target_tokens": RawTensor([1, 2, 3, 4], "int64", [2, 2]),
                           "weights": RawTensor([1.0] * 4, "float32", [2, 2])})], "cross_entropy",
     "data[0].loss_fn_inputs.target_tokens", "rows"),
])
def test_what_two_d_inputs_may_be(data, loss_fn, field, words):
    if field is None:
        normalise(data, spec_of(loss_fn), LIMITS)
        return
    extra = {"logprobs": RawTensor([0.0] * 5, "float32", [5]), "advantages": RawTensor([0.0] * 5, "float32", [5])}
    if loss_fn != "cross_entropy":
        data = [RawDatum(d.tokens, {**d.inputs, **extra}) for d in data]
    with pytest.raises(InvalidInput) as err:
        normalise(data, spec_of(loss_fn), LIMITS)
    assert err.value.field == field and words in str(err.value), str(err.value)


def _proto_request(tensor_of, n: int = 4) -> bytes:
    from tinker.proto import tinker_public_pb2 as pb

    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.arange(1, n + 1, dtype="<i4").tobytes()
    for key, t in tensor_of(pb).items():
        d.loss_fn_inputs[key].CopyFrom(t)
    return msg.SerializeToString()


def _csr(pb, dense: np.ndarray, dtype: int) -> object:
    rows, cols = np.nonzero(dense)
    crow = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=dense.shape[0]))]).astype("<i8")
    t = pb.Tensor(dtype=dtype, shape=list(dense.shape))
    t.sparse_csr.values = dense[rows, cols].astype("<f4" if dtype == pb.DTYPE_FLOAT32 else "<i8").tobytes()
    t.sparse_csr.crow_indices = crow.tobytes()
    t.sparse_csr.col_indices = cols.astype("<i8").tobytes()
    return t


def test_sparse_csr_inputs_decode_to_the_dense_tensor():
    targets = np.array([[5, 6], [0, 0], [7, 0], [8, 9]])
    weights = np.array([[0.75, 0.25], [0.0, 0.0], [1.0, 0.0], [0.5, 0.5]], dtype="<f4")

    def tensors(pb):
        return {"target_tokens": _csr(pb, targets, pb.DTYPE_INT64), "weights": _csr(pb, weights, pb.DTYPE_FLOAT32)}

    parsed = tinker_proto.decode_forward_backward(_proto_request(tensors), max_sparse_values=1 << 20)
    (datum,), _ = normalise(parsed.data, spec_of("cross_entropy"), LIMITS)
    assert datum.width == 2
    assert datum.inputs["target_tokens"] == tuple(targets.ravel().tolist())
    assert datum.inputs["weights"] == tuple(weights.ravel().tolist())
    with pytest.raises(InvalidInput, match="split the request"):
        tinker_proto.decode_forward_backward(_proto_request(tensors), max_sparse_values=10)


@pytest.mark.parametrize("mangle", ["shape", "crow", "cols", "negative"])
def test_a_sparse_tensor_that_lies_about_itself_is_refused_before_it_is_expanded(mangle):
    def tensors(pb):
        t = _csr(pb, np.array([[1.0, 0.0], [0.0, 2.0], [0.0, 0.0], [3.0, 0.0]], dtype="<f4"), pb.DTYPE_FLOAT32)
        if mangle == "shape":
            del t.shape[:]
            t.shape.extend([4, 1 << 40])
        elif mangle == "crow":
            t.sparse_csr.crow_indices = np.array([0, 1, 5, 2, 3], dtype="<i8").tobytes()
        elif mangle == "cols":
            t.sparse_csr.col_indices = np.array([0, 9, 0], dtype="<i8").tobytes()
        else:
            del t.shape[:]
            t.shape.extend([-4, -2])
        return {"weights": t}

    with pytest.raises(InvalidInput) as err:
        tinker_proto.decode_forward_backward(_proto_request(tensors), max_sparse_values=1 << 20)
    assert err.value.field == "data[0].loss_fn_inputs.weights"


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    be = LoraBackend(build_tiny_model(tmp_path_factory.mktemp("tiny") / "m").path)
    be.create("m", LoraShape(rank=4, seed=0))
    return be


def _pass(be, data, forward_only=True):
    req = PassRequest("r", "m", PassWork("cross_entropy", LossConfig(), tuple(data)), forward_only)
    out = be.run_pass([req])[0]
    assert isinstance(out, dict), out
    return out


def test_top_k_loss_is_the_weighted_sum_of_each_candidates_loss(backend):
    tokens = tuple(range(3, 15))
    n, k = len(tokens), 3
    candidates = [tuple((t * (j + 2)) % 1000 for t in range(n)) for j in range(k)]
    weights = [tuple(float(j + 1) / 6 for _ in range(n)) for j in range(k)]
    wide = Datum(tokens, {"target_tokens": tuple(c[t] for t in range(n) for c in candidates),
                          "weights": tuple(w[t] for t in range(n) for w in weights)}, width=k)
    narrow = [Datum(tokens, {"target_tokens": c, "weights": w}) for c, w in zip(candidates, weights)]
    # A wide datum and narrow ones in one pass: the micro-batch holds both widths.
    out = _pass(backend, [wide, *narrow])
    singles = [_pass(backend, [d])["metrics"]["loss:sum"] for d in narrow]
    wide_alone = _pass(backend, [wide])
    assert wide_alone["metrics"]["loss:sum"] == pytest.approx(sum(singles), rel=1e-5)
    assert out["loss_fn_outputs"][0]["logprobs"]["shape"] == [n, k]
    assert out["loss_fn_outputs"][1]["logprobs"]["shape"] == [n]
    lp = torch.tensor(out["loss_fn_outputs"][0]["logprobs"]["data"]).view(n, k)
    for j in range(k):
        torch.testing.assert_close(lp[:, j], torch.tensor(out["loss_fn_outputs"][1 + j]["logprobs"]["data"]))


def test_the_protobuf_answer_carries_the_trailing_shape():
    from tinker.proto import tinker_public_pb2 as pb

    result = {"loss_fn_outputs": [{"logprobs": {"data": [[0.0, 1.0]] * 3, "dtype": "float32", "shape": [3, 2]}}],
              "metrics": {"loss:sum": 1.0}}
    out = pb.ForwardBackwardOutput.FromString(tinker_proto.encode_forward_backward_output(result))
    assert list(out.loss_fn_outputs[0].fields["logprobs"].trailing_shape) == [2]
