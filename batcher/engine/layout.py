"""Where a fused pass puts its rows: micro-batches, streams and the adapter segments over them.

Pure functions over plain data (lengths, adapter keys, budgets), decided on the host before a pass
touches the device. Two layouts:

* packed: rows ordered by adapter go one after another into streams of `width` tokens, each row
  attending only to itself (a block-diagonal causal mask, its positions restarting at 0), so the
  only padding is each stream's tail. Used wherever the base's attention allows it.
* padded: one row per stream, right-padded to the longest row of its micro-batch (what every
  causal LM accepts; the fallback where packing would change the model's answer, see `can_pack`).

Either way a row's tokens are contiguous in the flattened (streams x width) token order and each
adapter's rows are adjacent, so a multi-LoRA layer sees one contiguous segment per adapter and
stream (`segments`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

A = TypeVar("A")  # what names a row's adapter (its slab name)


@dataclass(frozen=True)
class Layout:
    """One micro-batch: `rows` (indices into the pass's rows) in layout order, each starting at the
    flat token `starts[i]` of a (streams, width) token grid."""

    rows: tuple[int, ...]
    starts: tuple[int, ...]
    streams: int
    width: int
    packed: bool

    @property
    def tokens(self) -> int:
        return self.streams * self.width


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def can_pack(config: Mapping[str, Any], longest: int) -> bool:
    """Whether a packed stream computes what separate rows would, for rows of up to `longest` tokens.

    It does on every supported base: the packed attention (batcher.engine.packed_attention) applies
    each layer's own sliding window (transformers hands it `sliding_window`) and attention sinks
    within each row, so a row longer than the window packs too. Kept as the one place a base whose
    attention could not be packed exactly would say so (`config`, `longest`).
    """
    return True


def micro_batches(lengths: Sequence[int], keys: Sequence[object], *, budget: int, pack: bool, pack_width: int,
                  align: int = 1) -> list[Layout]:
    """Split rows (their token `lengths`, adapter `keys` to group by) into micro-batches of at most
    `budget` computed tokens (a longer row goes alone) and lay each out.

    Packed: rows by adapter, then by length; a micro-batch's streams are `pack_width` tokens (at
    most its own total, at least its longest row), rounded up to `align` (16-byte strides for
    grouped GEMM). Padded: rows by length, so rows of like length share a micro-batch, as before
    packing existed; within one, by adapter."""
    if not lengths:
        return []
    if pack:
        order = sorted(range(len(lengths)), key=lambda i: (keys[i], lengths[i], i))
        groups: list[list[int]] = [[]]
        total = 0
        for i in order:
            if groups[-1] and total + lengths[i] > budget:
                groups.append([])
                total = 0
            groups[-1].append(i)
            total += lengths[i]
        return [_pack(g, lengths, pack_width, align) for g in groups]
    groups = [[]]
    longest = 0
    for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        longest_if_added = max(longest, lengths[i])
        if groups[-1] and longest_if_added * (len(groups[-1]) + 1) > budget:
            groups.append([])
            longest_if_added = lengths[i]
        groups[-1].append(i)
        longest = longest_if_added
    layouts = []
    for g in groups:
        g = sorted(g, key=lambda i: (keys[i], i))
        width = round_up(max(lengths[i] for i in g), align)
        layouts.append(Layout(tuple(g), tuple(b * width for b in range(len(g))), len(g), width, False))
    return layouts


def _pack(rows: list[int], lengths: Sequence[int], pack_width: int, align: int) -> Layout:
    longest = max(lengths[i] for i in rows)
    width = round_up(max(longest, min(pack_width, sum(lengths[i] for i in rows))), align)
    starts, stream, fill = [], 0, 0
    for i in rows:
        if fill + lengths[i] > width:
            stream, fill = stream + 1, 0
        starts.append(stream * width + fill)
        fill += lengths[i]
    return Layout(tuple(rows), tuple(starts), stream + 1, width, True)


def segments(layout: Layout, lengths: Sequence[int], adapters: Sequence[A]) -> list[tuple[A | None, int, int]]:
    """(adapter, start, end) runs of flat tokens covering the whole grid in order; padding is
    adapter None. Adjacent rows of one adapter make one run."""
    out: list[tuple[A | None, int, int]] = []

    def add(adapter: A | None, start: int, end: int) -> None:
        if start == end:
            return
        if out and out[-1][0] == adapter and out[-1][2] == start:
            out[-1] = (adapter, out[-1][1], end)
        else:
            out.append((adapter, start, end))

    at = 0
    for row, start in zip(layout.rows, layout.starts):
        add(None, at, start)
        add(adapters[row], start, start + lengths[row])
        at = start + lengths[row]
    add(None, at, layout.tokens)
    return out


def window(runs: Sequence[tuple[A, int, int]], start: int, end: int) -> list[tuple[A, int, int]]:
    """The runs of tokens [start, end), renumbered from 0 (a chunk of the grid)."""
    return [(a, max(s, start) - start, min(e, end) - start) for a, s, e in runs if s < end and e > start]


def chunks(total: int, per_chunk: int) -> list[tuple[int, int]]:
    """[start, end) ranges of at most `per_chunk` tokens covering `total`."""
    per_chunk = max(1, per_chunk)
    return [(s, min(s + per_chunk, total)) for s in range(0, total, per_chunk)]


def rank_shares(lengths: Sequence[int], ranks: int) -> list[tuple[int, ...]]:
    """Which rows each rank of a data-parallel gang computes (`batcher.engine.data_parallel`): row
    indices per rank, in the pass's order, the ranks' token counts as even as whole rows allow.

    Longest row first, each to the rank with the fewest tokens so far (the lowest rank on a tie):
    no rank ends more than the longest row's tokens above another. With fewer rows than ranks the last
    ranks get none."""
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, not {ranks}")
    shares: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        shares[rank].append(i)
        load[rank] += lengths[i]
    return [tuple(sorted(s)) for s in shares]
