"""Data types: list conversion, dtypes by key, helpers."""

import pytest
import quilt


class FakeArray:
    """Stands in for a numpy array / torch tensor: has .tolist() and .dtype."""

    def __init__(self, values, dtype):
        self._values, self.dtype = values, dtype

    def tolist(self):
        return self._values


def test_lists_get_dtype_from_key():
    datum = quilt.Datum(
        model_input=quilt.ModelInput.from_ints([1, 2]),
        loss_fn_inputs={"target_tokens": [2, 3], "weights": [1, 0], "advantages": [0.5, 0.5]},
    )
    dtypes = {k: v.dtype for k, v in datum.loss_fn_inputs.items()}
    assert dtypes == {"target_tokens": "int64", "weights": "float32", "advantages": "float32"}
    assert datum.loss_fn_inputs["weights"].data == [1.0, 0.0]


def test_unknown_key_list_is_refused_with_hint():
    with pytest.raises(ValueError, match="TensorData"):
        quilt.Datum(quilt.ModelInput.from_ints([1]), {"mystery": [1.0]})


def test_unknown_key_accepts_tensordata_and_arrays():
    datum = quilt.Datum(
        quilt.ModelInput.from_ints([1]),
        {"a": quilt.TensorData([1.0], "float32"), "b": FakeArray([[1, 2]], "torch.int32")},
    )
    assert datum.loss_fn_inputs["b"].dtype == "int64" and datum.loss_fn_inputs["b"].shape == [1, 2]


def test_tolist_objects_are_accepted():
    datum = quilt.Datum(
        quilt.ModelInput.from_ints(FakeArray([4, 5], "int64")),
        {"target_tokens": FakeArray([5, 6], "int64")},
    )
    assert datum.model_input.to_ints() == [4, 5]
    assert datum.loss_fn_inputs["target_tokens"].to_json() == {"data": [5, 6], "dtype": "int64", "shape": [2]}


def test_tensordata_nested_roundtrip():
    tensor = quilt.TensorData.from_list([[1, 2, 3], [4, 5, 6]], "int64")
    assert tensor.data == [1, 2, 3, 4, 5, 6] and tensor.shape == [2, 3]
    assert tensor.tolist() == [[1, 2, 3], [4, 5, 6]]


def test_tensordata_rejects_bad_dtype_and_shape():
    with pytest.raises(ValueError):
        quilt.TensorData([1], "float64")
    with pytest.raises(ValueError):
        quilt.TensorData([1, 2, 3], "int64", shape=[2, 2])


def test_model_input_length_and_chunks():
    mi = quilt.ModelInput([quilt.EncodedTextChunk([1, 2]), quilt.EncodedTextChunk([3])])
    assert mi.length == 3 and mi.to_ints() == [1, 2, 3]


def test_datum_for_next_token_defaults():
    datum = quilt.datum_for_next_token([10, 11, 12, 13])
    assert datum.model_input.to_ints() == [10, 11, 12]
    assert datum.loss_fn_inputs["target_tokens"].data == [11, 12, 13]
    assert datum.loss_fn_inputs["weights"].data == [1.0, 1.0, 1.0]


def test_datum_for_next_token_accepts_per_token_weights():
    datum = quilt.datum_for_next_token([1, 2, 3], weights=[0.0, 0.0, 1.0])
    assert datum.loss_fn_inputs["weights"].data == [0.0, 1.0]


def test_datum_for_next_token_rejects_wrong_weight_count():
    with pytest.raises(ValueError, match="weights"):
        quilt.datum_for_next_token([1, 2, 3], weights=[1.0])


def test_forward_backward_output_from_json():
    out = quilt.ForwardBackwardOutput.from_json({
        "loss_fn_output_type": "cross_entropy",
        "loss_fn_outputs": [{"logprobs": {"data": [-1.0], "dtype": "float32", "shape": [1]}}],
        "metrics": {"loss:sum": 2.0},
    })
    assert out.loss == 2.0 and out.loss_fn_outputs[0]["logprobs"].tolist() == [-1.0]


def test_adam_params_validation():
    with pytest.raises(ValueError):
        quilt.AdamParams(learning_rate=-1)
