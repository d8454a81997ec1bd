"""Sampling outputs computed beside the sampled sequences: target prompt logprobs and prompt
alternatives (tinker's `target_prompt_logprobs` and `prompt_alt_tokens_k`). Pure functions over plain
data: the API checks a request with `parse_targets`, the scheduler asks the engine for the rows
`probe_rows` names and lays the answers out with `target_tensor` and `alt_tensors`.

How they are computed: vLLM gives prompt logprobs only for the prompt's own token and the top k, so
the logprob of any other token at prompt position p is read where vLLM does give it, as the
next-token distribution after the prefix `prompt[:p]`: one one-token "probe" per scored row, on that
prefix, asking for exactly those ids (`logprob_token_ids`) and for k draws at the request's
temperature (`n=k`). The numbers are the raw model logprobs every other output carries, and the
prefix is the prompt's own, so the prefix cache serves most of each probe.

`PromptTargets` keeps the request's layout: dense `[rows, K]` cells in row order, or CSR (row
pointers, column indices and one id per listed cell); the answer has the same shape and layout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from core.errors import InvalidInput

FIELD = "target_prompt_logprobs"
# vLLM scores at most this many named ids in one request (vllm.sampling_params.MAX_LOGPROB_TOKEN_IDS).
MAX_TARGET_WIDTH = 128
NO_TARGET = -1


@dataclass(frozen=True)
class PromptTargets:
    """Token ids to score per prompt row (row i scores prompt position i + 1); -1: nothing."""

    rows: int
    width: int
    ids: tuple[int, ...]  # dense: rows * width cells, row by row; CSR: one per listed cell
    crow: tuple[int, ...] | None = None  # CSR row pointers (rows + 1), or None when dense
    cols: tuple[int, ...] | None = None

    def cells(self) -> list[tuple[int, int]]:
        """(row, id) of every cell, in `ids` order."""
        if self.crow is None:
            return [(i // self.width, t) for i, t in enumerate(self.ids)]
        return [(r, self.ids[j]) for r in range(self.rows) for j in range(self.crow[r], self.crow[r + 1])]

    def to_json(self) -> dict[str, Any]:
        return {"rows": self.rows, "width": self.width, "ids": list(self.ids),
                "crow": None if self.crow is None else list(self.crow),
                "cols": None if self.cols is None else list(self.cols)}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any] | None) -> PromptTargets | None:
        if not obj:
            return None
        crow, cols = obj.get("crow"), obj.get("cols")
        return cls(int(obj["rows"]), int(obj["width"]), tuple(obj["ids"]),
                   None if crow is None else tuple(crow), None if cols is None else tuple(cols))


def _ints(value: object, what: str, field: str) -> list[int]:
    """A list of exact integers (no bools, no floats: an id written 5.0 or NaN is refused)."""
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise InvalidInput(f"{field}: {what} must be a list of integers", field=field)
    return value


def _csr(obj: Mapping[str, Any], rows: int, width: int, nnz: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    crow = _ints(obj.get("sparse_crow_indices"), "sparse_crow_indices", FIELD)
    cols = _ints(obj.get("sparse_col_indices"), "sparse_col_indices", FIELD)
    bad = len(crow) != rows + 1 or crow[0] != 0 or crow[-1] != nnz or len(cols) != nnz
    bad = bad or any(b < a for a, b in zip(crow, crow[1:], strict=False))
    if not bad:  # within a row: columns in [0, K), strictly increasing (sorted, none listed twice)
        for r in range(rows):
            row = cols[crow[r]:crow[r + 1]]
            if any(not 0 <= c < width for c in row) or any(b <= a for a, b in zip(row, row[1:], strict=False)):
                bad = True
                break
    if bad:
        raise InvalidInput(f"{FIELD}: sparse CSR indices do not describe a [{rows}, {width}] tensor with {nnz} "
                           "values (row pointers from 0 to the value count, non-decreasing; each row's columns "
                           f"sorted, distinct and in [0, {width}))", field=FIELD)
    return tuple(crow), tuple(cols)


def parse_targets(obj: object, *, prompt_len: int, vocab: int, max_rows: int) -> PromptTargets:
    """Check a request's `target_prompt_logprobs` (tinker TensorData as JSON: int64, shape
    `[len(prompt) - 1, K]`, dense or sparse CSR) against the prompt, the vocabulary and the limits:
    K <= MAX_TARGET_WIDTH, at most `max_rows` rows naming an id, at least one id. 400 otherwise."""
    if not isinstance(obj, Mapping):
        raise InvalidInput(f"{FIELD} must be a tensor object (data, dtype, shape)", field=FIELD)
    if obj.get("dtype") not in (None, "int64"):
        raise InvalidInput(f"{FIELD} must be an int64 tensor of token ids, got dtype {obj.get('dtype')!r}", field=FIELD)
    shape = _ints(obj.get("shape"), "shape", FIELD)
    rows = prompt_len - 1
    if len(shape) != 2 or shape[0] != rows or not 1 <= shape[1] <= MAX_TARGET_WIDTH:
        raise InvalidInput(f"{FIELD} must have shape [len(prompt) - 1, K] = [{rows}, K] with K in "
                           f"[1, {MAX_TARGET_WIDTH}], got {shape}", field=FIELD)
    width = shape[1]
    data = obj.get("data")
    if isinstance(data, list) and len(data) > rows * width:  # before anything walks it
        raise InvalidInput(f"{FIELD}: more values than a [{rows}, {width}] tensor holds", field=FIELD)
    ids = _ints(data, "data", FIELD)
    sparse = obj.get("sparse_crow_indices") is not None or obj.get("sparse_col_indices") is not None
    crow = cols = None
    if sparse:
        crow, cols = _csr(obj, rows, width, len(ids))
    elif len(ids) != rows * width:
        raise InvalidInput(f"{FIELD}: a dense [{rows}, {width}] tensor has {rows * width} values, got {len(ids)}",
                           field=FIELD)
    bad = next((t for t in ids if not NO_TARGET <= t < vocab), None)
    if bad is not None:
        raise InvalidInput(f"{FIELD}: token id {bad} is outside the vocabulary [0, {vocab}) (-1: no target)",
                           field=FIELD)
    targets = PromptTargets(rows, width, tuple(ids), crow, cols)
    scored = len(probe_rows(targets))
    if scored == 0:
        raise InvalidInput(f"{FIELD} names no token id (every cell is -1); leave it out instead", field=FIELD)
    if scored > max_rows:
        raise InvalidInput(f"{FIELD} scores {scored} prompt rows, more than the limit of {max_rows} "
                           "(QUILT_GEN_MAX_PROBE_ROWS)", field=FIELD)
    return targets


def probe_rows(targets: PromptTargets | None, alt_rows: int = 0) -> dict[int, tuple[int, ...]]:
    """Row -> the distinct ids to score there, for every row that names one; with `alt_rows`, every
    row below it too (alternatives are drawn at every row), with no ids where none are named."""
    wanted: dict[int, set[int]] = {r: set() for r in range(alt_rows)}
    for row, token in targets.cells() if targets is not None else ():
        if token != NO_TARGET:
            wanted.setdefault(row, set()).add(token)
    return {r: tuple(sorted(ids)) for r, ids in sorted(wanted.items())}


@dataclass(frozen=True)
class Probe:
    """What one row's probe found: logprobs of the ids asked for, and the draws (token, logprob)."""

    scores: Mapping[int, float]
    draws: tuple[tuple[int, float], ...] = ()


def _tensor(values: Sequence[float | int], dtype: str, shape: list[int], csr: PromptTargets | None = None) -> dict:
    out: dict[str, Any] = {"data": list(values), "dtype": dtype, "shape": shape}
    if csr is not None and csr.crow is not None:
        out["sparse_crow_indices"], out["sparse_col_indices"] = list(csr.crow), list(csr.cols or ())
    return out


def target_tensor(targets: PromptTargets, probes: Mapping[int, Probe]) -> dict[str, Any]:
    """The answer: float32 logprobs in the request's shape and layout, 0.0 where it had -1."""
    values = [0.0 if t == NO_TARGET else _finite(probes[r].scores.get(t)) for r, t in targets.cells()]
    return _tensor(values, "float32", [targets.rows, targets.width], targets)


def alt_tensors(rows: int, k: int, probes: Mapping[int, Probe]) -> dict[str, Any]:
    """`prompt_alt_tokens`: int64 tokens and float32 logprobs, both `[rows, k]`."""
    tokens = [t for r in range(rows) for t, _ in probes[r].draws[:k]]
    logprobs = [_finite(lp) for r in range(rows) for _, lp in probes[r].draws[:k]]
    if len(tokens) != rows * k:
        raise ValueError(f"expected {k} draws at each of {rows} rows, got {len(tokens)} in all")
    return {"tokens": _tensor(tokens, "int64", [rows, k]), "logprobs": _tensor(logprobs, "float32", [rows, k])}


def _finite(x: float | None) -> float:
    """vLLM gives -inf for a token the model rules out entirely; float32 JSON carries the most
    negative finite float32 in its place (JSON has no infinity), and a missing score is a bug."""
    if x is None:
        raise ValueError("the engine returned no logprob for a requested token")
    return -3.4028234663852886e38 if math.isinf(x) and x < 0 else float(x)
