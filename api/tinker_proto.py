"""The protobuf encoding the official tinker SDK uses, translated to and from the same plain data
the JSON routes use, so both encodings run one implementation.

Requests: `ForwardBackwardRequest` (decompressed by `api.body_limit`) -> fields + `RawDatum`s for
`api.datums.normalise`. Results: the JSON results the workers store -> `ForwardBackwardOutput` and
`SampleResponse` bytes. Message classes come from the tinker SDK's own generated module, so the
wire format is exactly what that SDK version reads and writes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from api import provenance
from api.datums import RawDatum, RawImage, RawTensor
from api.input_guard import check_text
from core.errors import InvalidInput
from core.loss_spec import MAX_TARGET_WIDTH

PROTOBUF = "application/x-protobuf"


def _pb():
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


@dataclass(frozen=True)
class ForwardBackwardProto:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[RawDatum]


def _np_dtype(pb, dtype: int, field: str):
    if dtype == pb.DTYPE_FLOAT32:
        return np.dtype("<f4"), "float32"
    if dtype == pb.DTYPE_INT64:
        return np.dtype("<i8"), "int64"
    if dtype == pb.DTYPE_INT32:
        return np.dtype("<i4"), "int64"
    raise InvalidInput(f"{field}: tensor dtype {dtype} is not supported (float32, int64, int32)", field=field)


class _SparseBudget:
    """The cells a request's sparse tensors may expand to, in all."""

    def __init__(self, cells: int) -> None:
        self.left = cells

    def take(self, cells: int, field: str) -> None:
        self.left -= cells
        if self.left < 0:
            raise InvalidInput(f"{field}: the request's sparse tensors expand past what the body limit allows "
                               "dense; split the request", field=field)


def _tensor(pb, t, field: str, rows: int, budget: _SparseBudget) -> RawTensor:
    """A dense tensor, or a 2-D sparse CSR one (the SDK sends top-K targets that way when smaller)
    made dense. `rows` is the datum's token count: a sparse tensor's shape is checked against it,
    MAX_TARGET_WIDTH and the budget before anything is allocated."""
    np_dtype, name = _np_dtype(pb, t.dtype, field)
    if t.WhichOneof("encoding") == "sparse_csr":
        return RawTensor(_dense_from_csr(t, np_dtype, field, rows, budget).tolist(), name, list(t.shape))
    if len(t.dense) % np_dtype.itemsize:
        raise InvalidInput(f"{field}: {len(t.dense)} bytes is not a whole number of {name} values", field=field)
    values = np.frombuffer(t.dense, dtype=np_dtype)
    return RawTensor(values.tolist(), name, list(t.shape) or None)


def _int64s(raw: bytes, field: str) -> np.ndarray:
    if len(raw) % 8:
        raise InvalidInput(f"{field}: {len(raw)} bytes is not a whole number of int64 indices", field=field)
    return np.frombuffer(raw, dtype="<i8")


def _dense_from_csr(t, np_dtype, field: str, rows: int, budget: _SparseBudget) -> np.ndarray:
    shape = list(t.shape)
    if len(shape) != 2 or shape[0] != rows or not 1 <= shape[1] <= MAX_TARGET_WIDTH:
        raise InvalidInput(f"{field}: a sparse tensor must have shape [{rows}, K] with K in [1, {MAX_TARGET_WIDTH}] "
                           f"(the datum's tokens, top-K targets), got {shape}", field=field)
    budget.take(rows * shape[1], field)
    csr = t.sparse_csr
    crow = _int64s(csr.crow_indices, f"{field}.crow_indices")
    cols = _int64s(csr.col_indices, f"{field}.col_indices")
    if len(csr.values) % np_dtype.itemsize:
        raise InvalidInput(f"{field}.values: {len(csr.values)} bytes is not a whole number of values", field=field)
    values = np.frombuffer(csr.values, dtype=np_dtype)
    nnz = len(values)
    if (len(crow) != rows + 1 or crow[0] != 0 or crow[-1] != nnz or np.any(np.diff(crow) < 0)
            or len(cols) != nnz or np.any(cols < 0) or np.any(cols >= shape[1])):
        raise InvalidInput(f"{field}: sparse CSR indices do not describe a [{rows}, {shape[1]}] tensor with "
                           f"{nnz} values", field=field)
    dense = np.zeros((rows, shape[1]), dtype=np_dtype)
    dense[np.repeat(np.arange(rows), np.diff(crow)), cols] = values
    return dense.ravel()


def decode_forward_backward(body: bytes, *, max_sparse_values: int,
                            on_ids: Callable[[str, int], None] | None = None) -> ForwardBackwardProto:
    """A ForwardBackwardRequest (already decompressed, within the body limit: api.body_limit).
    Its sparse tensors may expand to `max_sparse_values` values in all. `on_ids` hears the model
    and seq_id as soon as they are read, before the data is checked (a refusal of the data then
    uses up the seq_id: api.seq_gaps)."""
    pb = _pb()
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # DecodeError and friends: the body is not this message
        raise InvalidInput(f"body: not a ForwardBackwardRequest protobuf ({exc})", field="body") from None
    check_text(msg.model_id, "model_id")
    if on_ids is not None and 1 <= msg.seq_id < 2**31:
        on_ids(msg.model_id, msg.seq_id)
    check_text(msg.loss_fn, "loss_fn")
    config: dict[str, float | str] = {k: v for k, v in msg.loss_fn_config.items()}
    for key in (*msg.loss_fn_config, *msg.loss_fn_config_v2):
        check_text(key, "loss_fn_config")
    for key, value in msg.loss_fn_config_v2.items():  # v2 carries every value; it wins
        # Text (a custom loss's loss_id) is checked where the key is read (core.loss_spec: numbers only).
        config[key] = check_text(value.text, f"loss_fn_config.{key}") if value.WhichOneof("value") == "text" \
            else value.number
    data = []
    budget = _SparseBudget(max_sparse_values)
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        images: list[RawImage] = []
        for k, chunk in enumerate(d.model_input):
            kind = chunk.WhichOneof("chunk")
            if kind == "image":  # checked and turned into image tokens against the base (api.images)
                image = chunk.image
                images.append(RawImage(len(tokens), image.format, bytes(image.data),
                                       expected_tokens=image.expected_tokens if image.HasField("expected_tokens")
                                       else None))
                continue
            if kind != "encoded_text":
                what = "audio (dmel) chunks are not supported: no base model here takes audio" if kind == "dmel" \
                    else f"{kind} chunks are not supported"
                raise InvalidInput(f"data[{i}].model_input.chunks[{k}]: {what}", field=f"data[{i}].model_input")
            raw = chunk.encoded_text.tokens
            if len(raw) % 4:
                field = f"data[{i}].model_input"
                raise InvalidInput(f"{field}: {len(raw)} bytes of tokens is not a whole number of int32 ids",
                                   field=field)
            tokens += np.frombuffer(raw, dtype="<i4").tolist()
        for k in d.loss_fn_inputs:
            check_text(k, f"data[{i}].loss_fn_inputs")
        # An image takes the positions the client expects it to (checked against the base later).
        rows = len(tokens) + sum(image.expected_tokens or 0 for image in images)
        inputs = {k: _tensor(pb, t, f"data[{i}].loss_fn_inputs.{k}", rows, budget)
                  for k, t in d.loss_fn_inputs.items()}
        model_spans, loss_spans = (provenance.from_proto(spans, f"data[{i}].{name}") if spans else None
                                   for name, spans in (("model_input_spans", d.model_input_spans),
                                                       ("loss_fn_input_spans", d.loss_fn_input_spans)))
        data.append(RawDatum(tokens, inputs, raw_images=tuple(images),
                             provenance=provenance.pair(model_spans, loss_spans, f"data[{i}]")))
    return ForwardBackwardProto(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, data)


def encode_forward_backward_output(result: dict) -> bytes:
    """One ArrayRecord: per field, every datum's values concatenated, with byte offsets."""
    pb = _pb()
    out = pb.ForwardBackwardOutput(loss_fn_output_type=result.get("loss_fn_output_type", "ArrayRecord"))
    outputs = result.get("loss_fn_outputs", [])
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
    keys = [k for k in (outputs[0] if outputs else {}) if all(k in o for o in outputs)]
    for key in keys:
        arrays = [np.asarray(o[key]["data"], dtype="<f4") for o in outputs]
        offsets = np.concatenate([[0], np.cumsum([a.nbytes for a in arrays])]).astype("<i8")
        tensor = record.fields[key]
        tensor.data = b"".join(a.tobytes() for a in arrays)
        tensor.offsets = offsets.tobytes()
        tensor.dtype = pb.DTYPE_FLOAT32
        # [n, K] outputs of top-K targets (every datum of a request has the same K: api.datums).
        tensor.trailing_shape.extend(outputs[0][key].get("shape", [0])[1:])
    for name, value in result.get("metrics", {}).items():
        out.metrics[name] = float(value)
    return out.SerializeToString()


def encode_sample_response(result: dict) -> bytes:
    pb = _pb()
    out = pb.SampleResponse()
    for seq in result.get("sequences", []):
        s = out.sequences.add()
        s.stop_reason = pb.STOP_REASON_LENGTH if seq.get("stop_reason") == "length" else pb.STOP_REASON_STOP
        s.tokens = np.asarray(seq.get("tokens", []), dtype="<i4").tobytes()
        s.logprobs = np.asarray([math.nan if v is None else v for v in seq.get("logprobs") or []], dtype="<f4").tobytes()
        if seq.get("topk_logprobs") is not None:
            _fill_topk(s.topk_sampled_logprobs, seq["topk_logprobs"])
    prompt = result.get("prompt_logprobs")
    if prompt is not None:
        out.prompt_logprobs = np.asarray([math.nan if v is None else v for v in prompt], dtype="<f4").tobytes()
    topk = result.get("topk_prompt_logprobs")
    if topk is not None:
        _fill_topk(out.topk_prompt_logprobs, topk)
    if result.get("target_prompt_logprobs") is not None:
        _fill_tensor(pb, out.target_prompt_logprobs, result["target_prompt_logprobs"])
    out.prompt_cache_hit_tokens = int(result.get("prompt_cache_hit_tokens") or 0)
    alts = result.get("prompt_alt_tokens")
    if alts is not None:
        _fill_tensor(pb, out.prompt_alt_tokens.tokens, alts["tokens"])
        _fill_tensor(pb, out.prompt_alt_tokens.logprobs, alts["logprobs"])
    return out.SerializeToString()


def _fill_tensor(pb, msg, tensor: dict) -> None:
    """A TensorData as JSON (gen_pool.outputs) into a proto Tensor, sparse CSR kept sparse."""
    np_dtype, msg.dtype = ("<f4", pb.DTYPE_FLOAT32) if tensor["dtype"] == "float32" else ("<i8", pb.DTYPE_INT64)
    msg.shape.extend(tensor["shape"])
    values = np.asarray(tensor["data"], dtype=np_dtype).tobytes()
    if tensor.get("sparse_crow_indices") is None:
        msg.dense = values
        return
    msg.sparse_csr.values = values
    msg.sparse_csr.crow_indices = np.asarray(tensor["sparse_crow_indices"], dtype="<i8").tobytes()
    msg.sparse_csr.col_indices = np.asarray(tensor["sparse_col_indices"], dtype="<i8").tobytes()


# What the SDK reads as "nothing here" in a TopkLogprobs matrix (tinker.types.topk_logprobs).
_TOPK_EMPTY_TOKEN, _TOPK_EMPTY_LOGPROB = 0, -99999.0


def _fill_topk(msg, rows: list) -> None:
    """Rows of [[token, logprob], ...] (or null) as two dense (length, k) matrices, short rows
    padded with the SDK's sentinel."""
    k = max((len(r) for r in rows if r), default=0)
    tokens = np.full((len(rows), k), _TOPK_EMPTY_TOKEN, dtype="<i4")
    logprobs = np.full((len(rows), k), _TOPK_EMPTY_LOGPROB, dtype="<f4")
    for i, row in enumerate(rows):
        for j, (token, lp) in enumerate(row or ()):
            tokens[i, j], logprobs[i, j] = token, math.nan if lp is None else lp
    msg.token_ids, msg.logprobs, msg.k, msg.length = tokens.tobytes(), logprobs.tobytes(), k, len(rows)


def wants_protobuf(accept: str | None) -> bool:
    return accept is not None and PROTOBUF in accept
