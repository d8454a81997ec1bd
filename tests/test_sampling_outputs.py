"""gen_pool.outputs as tables: what a `target_prompt_logprobs` tensor may be (dense or CSR, hostile
values refused with a 400 naming the field and the limit), which prompt rows get a probe, and how
the answers are laid out in the request's own layout."""

from __future__ import annotations

import math

import pytest

from core.errors import InvalidInput
from gen_pool import outputs, stability, wire
from gen_pool.outputs import Probe, PromptTargets

VOCAB = 100
PROMPT_LEN = 4  # three scored rows


def dense(rows: list[list[int]], **kw) -> dict:
    return {"data": [t for r in rows for t in r], "dtype": "int64", "shape": [len(rows), len(rows[0])], **kw}


def csr(crow: list[int], cols: list[int], data: list[int], width: int = 2, rows: int = 3) -> dict:
    return {"data": data, "dtype": "int64", "shape": [rows, width], "sparse_crow_indices": crow,
            "sparse_col_indices": cols}


def parse(obj, max_rows: int = 10) -> PromptTargets:
    return outputs.parse_targets(obj, prompt_len=PROMPT_LEN, vocab=VOCAB, max_rows=max_rows)


@pytest.mark.parametrize("obj, words", [
    ("not a tensor", "tensor object"),
    (dense([[1], [2], [3]], dtype="float32"), "int64"),
    (dense([[1], [2]]), "[3, K]"),  # rows must be len(prompt) - 1
    ({"data": [1, 2, 3], "dtype": "int64", "shape": [3]}, "[3, K]"),
    ({"data": [], "dtype": "int64", "shape": [3, 0]}, "K in [1, 128]"),
    ({"data": [1] * 3 * 129, "dtype": "int64", "shape": [3, 129]}, "K in [1, 128]"),
    ({"data": [1, 2], "dtype": "int64", "shape": [3, 1]}, "has 3 values, got 2"),
    ({"data": [1] * 10**6, "dtype": "int64", "shape": [3, 1]}, "more values than"),
    ({"data": [1, 2, 3], "dtype": "int64", "shape": None}, "shape"),
    ({"data": [1, 2, 3], "dtype": "int64", "shape": [3, 2**70]}, "K in [1, 128]"),
    ({"data": [1, 2, -(2**63)], "dtype": "int64", "shape": [3, 1]}, "outside the vocabulary"),
    (dense([[1], [2], [VOCAB]]), "outside the vocabulary [0, 100)"),
    (dense([[1], [-2], [3]]), "outside the vocabulary"),
    ({"data": [1, 2.0, 3], "dtype": "int64", "shape": [3, 1]}, "integers"),
    ({"data": [1, float("nan"), 3], "dtype": "int64", "shape": [3, 1]}, "integers"),
    ({"data": [1, True, 3], "dtype": "int64", "shape": [3, 1]}, "integers"),
    ({"data": "123", "dtype": "int64", "shape": [3, 1]}, "integers"),
    (dense([[-1], [-1], [-1]]), "names no token id"),
    # CSR: row pointers and columns that do not describe the shape
    (csr([0, 1, 2], [0, 0], [5, 6]), "sparse CSR"),  # too few row pointers
    (csr([1, 1, 2, 2], [0, 0], [5, 6]), "sparse CSR"),  # not from 0
    (csr([0, 2, 1, 2], [0, 1], [5, 6]), "sparse CSR"),  # decreasing
    (csr([0, 1, 2, 3], [0, 0], [5, 6]), "sparse CSR"),  # ends past the values
    (csr([0, 1, 1, 2], [0, 2], [5, 6]), "sparse CSR"),  # column out of range
    (csr([0, 1, 1, 2], [0, -1], [5, 6]), "sparse CSR"),  # negative column
    (csr([0, 2, 2, 2], [1, 0], [5, 6]), "sparse CSR"),  # unsorted within a row
    (csr([0, 2, 2, 2], [1, 1], [5, 6]), "sparse CSR"),  # the same cell twice
    (csr([0, 1, 1, 2], [0], [5, 6]), "sparse CSR"),  # fewer columns than values
    (csr([0, 1, 1, 2], None, [5, 6]), "sparse_col_indices"),
    (csr([0, 1, 1, 2], [0, 1.5], [5, 6]), "integers"),
    (csr([0, 1, 1, 2], [0, 1], [5, VOCAB + 7]), "outside the vocabulary"),
])
def test_refused_targets_name_the_field(obj, words):
    with pytest.raises(InvalidInput) as err:
        parse(obj)
    assert err.value.field == "target_prompt_logprobs" and words in err.value.message, err.value.message


def test_scored_rows_are_bounded():
    parse(dense([[1], [2], [3]]), max_rows=3)
    with pytest.raises(InvalidInput, match=r"scores 3 prompt rows, more than the limit of 2"):
        parse(dense([[1], [2], [3]]), max_rows=2)
    parse(dense([[1], [-1], [3]]), max_rows=2)  # a row of -1 is not scored


@pytest.mark.parametrize("obj, alt_rows, rows", [
    (dense([[7, -1], [-1, -1], [9, 7]]), 0, {0: (7,), 2: (7, 9)}),
    (dense([[7, 7], [-1, -1], [-1, 3]]), 0, {0: (7,), 2: (3,)}),  # an id named twice is scored once
    (csr([0, 1, 1, 3], [1, 0, 1], [4, 8, 2]), 0, {0: (4,), 2: (2, 8)}),
    (csr([0, 1, 1, 2], [1, 0], [-1, 8]), 0, {2: (8,)}),  # a listed -1 asks nothing
    (dense([[7], [-1], [-1]]), 3, {0: (7,), 1: (), 2: ()}),  # alternatives: every row
    (None, 2, {0: (), 1: ()}),
])
def test_probe_rows(obj, alt_rows, rows):
    targets = None if obj is None else parse(obj)
    assert outputs.probe_rows(targets, alt_rows) == rows


def test_answers_keep_the_request_layout():
    probes = {0: Probe({7: -1.5}), 2: Probe({7: -0.25, 9: float("-inf")})}
    got = outputs.target_tensor(parse(dense([[7, -1], [-1, -1], [9, 7]])), probes)
    assert got == {"data": [-1.5, 0.0, 0.0, 0.0, -3.4028234663852886e38, -0.25], "dtype": "float32", "shape": [3, 2]}
    sparse = csr([0, 1, 1, 3], [1, 0, 1], [7, -1, 9])
    got = outputs.target_tensor(parse(sparse), probes)
    assert got == {"data": [-1.5, 0.0, -3.4028234663852886e38], "dtype": "float32", "shape": [3, 2],
                   "sparse_crow_indices": [0, 1, 1, 3], "sparse_col_indices": [1, 0, 1]}
    with pytest.raises(ValueError):  # an id the engine did not answer is never reported as a number
        outputs.target_tensor(parse(dense([[5], [-1], [-1]])), probes)


def test_targets_travel_as_plain_data():
    for obj in (dense([[7, -1], [-1, -1], [9, 7]]), csr([0, 1, 1, 3], [1, 0, 1], [4, 8, 2])):
        targets = parse(obj)
        assert PromptTargets.from_json(targets.to_json()) == targets
    assert PromptTargets.from_json(None) is None


def test_alternatives_are_two_row_by_k_tensors():
    probes = {0: Probe({}, ((3, -1.0), (4, -2.0))), 1: Probe({}, ((5, -0.5), (5, -0.5)))}
    got = outputs.alt_tensors(2, 2, probes)
    assert got["tokens"] == {"data": [3, 4, 5, 5], "dtype": "int64", "shape": [2, 2]}
    assert got["logprobs"] == {"data": [-1.0, -2.0, -0.5, -0.5], "dtype": "float32", "shape": [2, 2]}
    with pytest.raises(ValueError):
        outputs.alt_tensors(2, 3, probes)


def test_stability_records_carry_no_nan():
    seq = wire.SampledSequence((1, 2), (-0.5, math.nan), "length", "m", 3, ((( 1, -0.5),), None))
    recs = stability.records("req", wire.SampleOutcome((seq,)), 4)
    assert list(recs) == ["req:0"]
    assert '"logprobs": [-0.5, null]' in recs["req:0"] and '"policy_version": 3' in recs["req:0"]
    assert stability.key("t1", "req:0") != stability.key("t2", "req:0")


def test_the_sdk_decodes_every_output_from_protobuf():
    pytest.importorskip("tinker")
    from tinker.proto.response_conv import deserialize_sample_response

    from api.tinker_proto import encode_sample_response

    targets = parse(csr([0, 1, 1, 3], [1, 0, 1], [7, -1, 9]))
    probes = {0: Probe({7: -1.5}, ((3, -1.0),)), 1: Probe({}, ((4, -2.0),)), 2: Probe({9: -0.25}, ((5, -0.5),))}
    seq = wire.SampledSequence((11, 12), (-0.5, -0.75), "length", "m", 0, (((11, -0.5), (13, -0.9)), ((12, -0.75),)))
    outcome = wire.SampleOutcome((seq,), target_prompt_logprobs=outputs.target_tensor(targets, probes),
                                 prompt_alt_tokens=outputs.alt_tensors(3, 1, probes), prompt_cache_hit_tokens=37)
    got = deserialize_sample_response(encode_sample_response(wire.to_json(outcome)))
    assert got.prompt_cache_hit_tokens == 37
    assert got.sequences[0].topk_logprobs == [[(11, -0.5), (13, pytest.approx(-0.9))], [(12, -0.75)]]
    assert got.target_prompt_logprobs.to_torch().tolist() == [[0.0, -1.5], [0.0, 0.0], [0.0, -0.25]]
    assert got.target_prompt_logprobs.sparse_crow_indices == [0, 1, 1, 3]
    assert got.prompt_alt_tokens.tokens.tolist() == [[3], [4], [5]]
    assert got.prompt_alt_tokens.logprobs.tolist() == [[-1.0], [-2.0], [-0.5]]


def test_the_kind_gate_keeps_probes_and_topk_apart_first_come_first_served():
    import asyncio

    from gen_pool.engine import KindGate

    async def scenario() -> list[str]:
        gate, log = KindGate(), []

        async def run(name: str, kind: str | None, hold: asyncio.Event) -> None:
            await gate.enter(kind)
            log.append(f"+{name}")
            assert gate.running["ids"] == 0 or gate.running["topk"] == 0
            await hold.wait()
            log.append(f"-{name}")
            await gate.leave(kind)

        go = {n: asyncio.Event() for n in "ABCDE"}
        tasks = [asyncio.create_task(run("A", "topk", go["A"]))]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(run("B", "ids", go["B"])))  # waits for A
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(run("C", "topk", go["C"])))  # after B: B came first
        tasks.append(asyncio.create_task(run("D", None, go["D"])))  # neither kind: straight in
        for _ in range(3):
            await asyncio.sleep(0)
        assert log == ["+A", "+D"]
        go["A"].set()
        for _ in range(5):
            await asyncio.sleep(0)
        go["B"].set()
        go["C"].set()
        go["D"].set()
        await asyncio.gather(*tasks)
        return log

    log = asyncio.run(scenario())
    assert log.index("+B") > log.index("-A") and log.index("+C") > log.index("-B")
