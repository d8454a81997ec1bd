"""Provenance: which sampled sequence each training token came from (tinker's `model_input_spans`
and `loss_fn_input_spans`), and what `stable_reinforce` makes of it.

A span names a sequence by the `sequence_id` its sampling future promised (gen_pool.stability) and
claims that a run of the datum's positions are positions `[offset, offset + length)` of that
sequence's prompt (`prompt_tokens`) or of its sampled tokens (`sampled_tokens`). The runs of one
field tile it: their lengths add up to the field's positions.

Every loss accepts provenance and checks its shape (bounded, tiling, text that can be stored); only
`stable_reinforce` reads it. For that loss `apply` looks up each named sequence's stability record
(the tenant's own: another tenant's id finds nothing), checks that each sampled run's tokens are the
ones the sampler produced, and rewrites the datum's inputs from the record:

- `logprobs` at a sampled position: the logprob the sampler recorded for that token, whatever the
  client sent (the loss must weigh against the policy that really sampled, in the numerics it ran);
- `advantages` on every position no sampled run covers (prompt tokens, observations) become 0: there
  is no sampler logprob to weigh them by;
- the datum's `policy_version`, when the client gave none: the oldest version behind its sampled
  runs, so staleness is measured and `max_staleness` applies.

Each read slides the record's expiry (QUILT_GEN_STABILITY_TTL_S), as Tinker's training requests
restart a recorded sequence's day.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from api.input_guard import check_text
from core.errors import InvalidInput
from core.loss_spec import STABLE_REINFORCE
from core.work import Datum, PassWork
from gen_pool import stability

MAX_SEQUENCE_ID = 300  # characters; the ids this server gives are far shorter
MAX_SPANS = 4096  # runs per field of one datum (api.schemas bounds the JSON lists the same)
MAX_SEQUENCES = 4096  # distinct sequences one request may name: one Redis read each
# Bytes of records one request may make the API read and parse. A tenant may keep gigabytes of them
# (QUILT_TENANT_MAX_RESULT_BYTES); a request naming all of them must not take the API's memory.
# A full request of sampled tokens with top-20 logprobs recorded stays well under this.
MAX_RECORD_BYTES = 256 * 2**20
_KINDS = {"prompt_tokens": "prompt", "sampled_tokens": "sampled"}


@dataclass(frozen=True)
class Span:
    kind: str  # "prompt" or "sampled"
    sequence_id: str
    offset: int
    length: int


@dataclass(frozen=True)
class Provenance:
    """One datum's spans, per field."""

    model_input: tuple[Span, ...]
    loss_fn_inputs: tuple[Span, ...]


def _int(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
        raise InvalidInput(f"{field}: must be an integer in [0, {2**31 - 1}], got {str(value)[:40]}", field=field)
    return value


def span(kind: str, sequence_id: object, offset: object, length: object, field: str) -> Span:
    """One run, checked: a stored-text id of at most MAX_SEQUENCE_ID characters, non-negative ints."""
    if not isinstance(sequence_id, str) or not sequence_id:
        raise InvalidInput(f"{field}.sequence_id: must be a non-empty string", field=f"{field}.sequence_id")
    if len(sequence_id) > MAX_SEQUENCE_ID:
        raise InvalidInput(f"{field}.sequence_id: longer than any this server gives ({MAX_SEQUENCE_ID} characters)",
                           field=f"{field}.sequence_id")
    check_text(sequence_id, f"{field}.sequence_id")
    return Span(kind, sequence_id, _int(offset, f"{field}.offset"), _int(length, f"{field}.length"))


def from_json(raw: Sequence[Any], field: str) -> tuple[Span, ...]:
    """Spans in the protobuf's JSON form: `{"sampled_tokens": {"sequence_id", "offset"?, "length"}}`
    or `{"prompt_tokens": {...}}`, one key each."""
    if len(raw) > MAX_SPANS:
        raise InvalidInput(f"{field}: {len(raw)} spans exceed the limit of {MAX_SPANS}", field=field)
    out = []
    for j, item in enumerate(raw):
        where = f"{field}[{j}]"
        if not isinstance(item, Mapping) or len(item) != 1 or next(iter(item)) not in _KINDS:
            raise InvalidInput(f"{where}: must be {{\"prompt_tokens\": {{...}}}} or {{\"sampled_tokens\": {{...}}}}",
                               field=where)
        [(key, body)] = item.items()
        if not isinstance(body, Mapping) or not set(body) <= {"sequence_id", "offset", "length"}:
            raise InvalidInput(f"{where}.{key}: takes sequence_id, offset and length", field=f"{where}.{key}")
        out.append(span(_KINDS[key], body.get("sequence_id"), body.get("offset", 0), body.get("length"),
                        f"{where}.{key}"))
    return tuple(out)


def from_proto(spans: Sequence[Any], field: str) -> tuple[Span, ...]:
    """Spans of a protobuf `Datum` (`tinker_public_pb2.ProvenanceSpan`, a oneof per run), read as
    their JSON form (a run with neither arm set is refused there)."""
    def as_json(s: Any) -> dict[str, Any]:
        key = s.WhichOneof("span")
        arm = getattr(s, key) if key else None
        return {} if arm is None else {key: {"sequence_id": arm.sequence_id, "offset": arm.offset, "length": arm.length}}

    if len(spans) > MAX_SPANS:  # before each run is converted
        raise InvalidInput(f"{field}: {len(spans)} spans exceed the limit of {MAX_SPANS}", field=field)
    return from_json([as_json(s) for s in spans], field)


def pair(model_input: tuple[Span, ...] | None, loss_fn_inputs: tuple[Span, ...] | None,
         where: str) -> Provenance | None:
    """Both fields or neither, as the tinker SDK sends them."""
    if (model_input is None) != (loss_fn_inputs is None):
        raise InvalidInput(f"{where}: provenance comes as a pair: send both model_input_spans and "
                           "loss_fn_input_spans or neither", field=f"{where}.loss_fn_input_spans")
    return None if model_input is None or loss_fn_inputs is None else Provenance(model_input, loss_fn_inputs)


def check_tiling(provenance: Provenance | None, positions: int, where: str) -> None:
    """Each field's runs cover exactly the datum's `positions` (its model input, image tokens included)."""
    if provenance is None:
        return
    for name, spans in (("model_input_spans", provenance.model_input), ("loss_fn_input_spans", provenance.loss_fn_inputs)):
        covered = sum(s.length for s in spans)
        if covered != positions:
            raise InvalidInput(f"{where}.{name}: the spans cover {covered} positions but the datum has {positions}; "
                               "they must tile it", field=f"{where}.{name}")


async def apply(redis, tenant_id: str, work: PassWork, provenance: Sequence[Provenance | None],
                ttl_s: int) -> PassWork:
    """`work` with each datum's inputs rewritten from the stability records its spans name (see the
    module docstring); `work` itself when its loss is not `stable_reinforce` (its spans, if any, must
    still tile each datum's `len(tokens)` positions, images included). InvalidInput naming
    the span for a datum without provenance, an id with no record of this tenant's, a run past the
    sequence's end, or sampled tokens that are not the sampler's."""
    for i, (datum, p) in enumerate(zip(work.data, provenance, strict=True)):
        check_tiling(p, len(datum.tokens), f"data[{i}]")
    if work.loss_fn != STABLE_REINFORCE:
        return work
    for i, p in enumerate(provenance):
        if p is None:
            raise InvalidInput(f"data[{i}].loss_fn_input_spans: {STABLE_REINFORCE} needs provenance: sample with "
                               "record_stability_info=True and name each token's sequence (Datum.with_provenance)",
                               field=f"data[{i}].loss_fn_input_spans")
    ids = sorted({s.sequence_id for p in provenance if p is not None for s in (*p.loss_fn_inputs, *p.model_input)})
    if len(ids) > MAX_SEQUENCES:
        raise InvalidInput(f"data: the request names {len(ids)} sampled sequences; the limit is {MAX_SEQUENCES}",
                           field="data")
    keys = [stability.key(tenant_id, sid) for sid in ids]
    async with redis.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.strlen(key)
        size = sum(await pipe.execute())
    if size > MAX_RECORD_BYTES:
        raise InvalidInput(f"data: the {len(ids)} sequences this request names hold {size} bytes of records; the "
                           f"limit is {MAX_RECORD_BYTES} per request; split it", field="data")
    async with redis.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.getex(key, ex=ttl_s)  # a training request restarts the record's time to live
        raw = await pipe.execute()
    records = {sid: json.loads(r) for sid, r in zip(ids, raw, strict=True) if r is not None}
    data = tuple(_rewrite(f"data[{i}]", d, p, records)
                 for i, (d, p) in enumerate(zip(work.data, provenance, strict=True)) if p is not None)
    return dataclasses.replace(work, data=data)


def _record(records: Mapping[str, dict], s: Span, field: str) -> dict:
    record = records.get(s.sequence_id)
    if record is None:
        raise InvalidInput(f"{field}.sequence_id: no recorded sequence {s.sequence_id!r}: not sampled with "
                           "record_stability_info, sampled with another API key's tenant, or past its time to live "
                           "(QUILT_GEN_STABILITY_TTL_S)", field=f"{field}.sequence_id")
    return record


def _rewrite(where: str, datum: Datum, p: Provenance, records: Mapping[str, dict]) -> Datum:
    for j, s in enumerate(p.model_input):  # only checked: the loss reads the targets' runs
        _within(_record(records, s, f"{where}.model_input_spans[{j}]"), s, f"{where}.model_input_spans[{j}]")
    targets = datum.inputs["target_tokens"]
    logprobs = [0.0] * len(targets)
    advantages = [0.0] * len(targets)
    versions: list[int] = []
    at = 0
    for j, s in enumerate(p.loss_fn_inputs):
        field = f"{where}.loss_fn_input_spans[{j}]"
        record = _record(records, s, field)
        _within(record, s, field)
        if s.kind == "sampled":
            sampled = record["tokens"][s.offset:s.offset + s.length]
            claimed = list(targets[at:at + s.length])
            if sampled != claimed:
                k = next(k for k, (a, b) in enumerate(zip(sampled, claimed, strict=True)) if a != b)
                raise InvalidInput(f"{field}: target_tokens[{at + k}] is {claimed[k]} but sampled token "
                                   f"{s.offset + k} of {s.sequence_id!r} is {sampled[k]}", field=field)
            for k, lp in enumerate(record["logprobs"][s.offset:s.offset + s.length]):
                if lp is not None:  # a position the sampler has no finite logprob for weighs nothing
                    logprobs[at + k] = lp
                    advantages[at + k] = datum.inputs["advantages"][at + k]
            if record.get("policy_version") is not None:
                versions.append(int(record["policy_version"]))
        at += s.length
    inputs = {**datum.inputs, "logprobs": tuple(logprobs), "advantages": tuple(advantages)}
    version = datum.policy_version if datum.policy_version is not None else min(versions, default=None)
    return dataclasses.replace(datum, inputs=inputs, policy_version=version)


def _within(record: dict, s: Span, field: str) -> None:
    size = record["prompt_length"] if s.kind == "prompt" else len(record["tokens"])
    if s.offset + s.length > size:
        what = "prompt" if s.kind == "prompt" else "sampled tokens"
        raise InvalidInput(f"{field}: positions [{s.offset}, {s.offset + s.length}) run past the {size} {what} of "
                           f"{s.sequence_id!r}", field=field)
