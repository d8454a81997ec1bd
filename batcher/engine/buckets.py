"""The sizes a captured pass is padded to, and which passes may be captured at all.

A CUDA graph replays fixed kernels on fixed addresses, so a pass can replay one only where every
shape and every host-side choice is the graph's: a pass is padded up to its *bucket* (the token
grid, the runs of each layer's route, the datums and requests of its loss, the packed rows'
boundaries) and every bucket is captured once (`batcher.engine.graphs`). Padding tokens belong to no
adapter (the slabs' zero row), padding datums and positions carry zero weight and are never kept.

Pure functions over plain numbers, table-tested (`tests/test_cuda_graphs.py`). The ladders trade
padding against the number of graphs: token widths go up by at most 1.5x (64, 96, 128, 192, ...),
counts by powers of two, so a pass computes at most half again its tokens and a trainer's rounds
fall into a few dozen buckets.
"""

from __future__ import annotations

from batcher.engine.layout import Layout, round_up

MIN_WIDTH = 64


def width(n: int, *, align: int = 1, cap: int = 0) -> int:
    """The bucket of a packed stream of `n` tokens: the next of 64, 96, 128, 192, 256, 384, ...
    (a multiple of `align`), but never past `cap` tokens (the pass's budget) where `n` is within it."""
    size = MIN_WIDTH
    while size < n:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    size = round_up(size, align)
    if cap and n <= cap < size:
        return round_up(n, align)
    return size


def count(n: int, floor: int = 1) -> int:
    """The bucket of a count: the next power of two, at least `floor`."""
    size = max(1, floor)
    while size < n:
        size *= 2
    return size


def layout(lay: Layout, *, align: int = 1, cap: int = 0) -> Layout:
    """A packed micro-batch laid out on its bucket's grid: each stream as wide as the width bucket
    (its rows where they were, the rest padding), as many streams as the count bucket (padding
    streams at the end). A padded (unpacked) layout is returned as it is."""
    if not lay.packed:
        return lay
    new_width = width(lay.width, align=align, cap=cap)
    streams = count(lay.streams)
    if cap and streams * new_width > max(cap, lay.streams * new_width):
        streams = lay.streams  # the budget is the memory plan's: more streams only within it
    starts = tuple((s // lay.width) * new_width + s % lay.width for s in lay.starts)
    return Layout(lay.rows, starts, streams, new_width, True)


def runs(n: int) -> int:
    """Runs of a layer's route (adapters and padding) in a captured pass."""
    return count(n, 4)


def datums(n: int) -> int:
    """Datums of a captured pass's loss: always one more than the pass has (the padding positions'
    datum, which is never kept)."""
    return count(n + 1, 8)


def requests(n: int) -> int:
    return count(n, 8)


def boundaries(n: int) -> int:
    """Entries of a captured pass's packed-row offsets (repeated last offsets: empty rows)."""
    return count(n, 8)


def refusal(*, device: str, enabled: bool, gang: int, packed: bool, experts: bool, grouped: bool,
            varlen: bool = True) -> str:
    """Why a micro-batch runs eagerly rather than from a captured graph ("" where it may be captured).

    `device`: the compute device's type; `enabled`: the trainer's setting (`QUILT_TRAINER_CUDA_GRAPHS`);
    `gang`: ranks of the trainer; `packed`: the layout packs rows (a sliding-window base's long rows
    go padded, with the model's own masks); `experts`: LoRA on a MoE base's experts is in the pass;
    `grouped`: every slab of the pass runs grouped GEMM (dtype and 16-byte strides allow it);
    `varlen`: the device's variable-length attention kernel works (without it a captured pass would
    attend over whole streams under a mask, quadratic in the stream's width)."""
    if not enabled:
        return "CUDA graphs are off (QUILT_TRAINER_CUDA_GRAPHS)"
    if device != "cuda":
        return "not a CUDA device: the pass runs eagerly"
    if gang > 1:
        return "a trainer gang's collectives are not captured"
    if not packed:
        return "padded rows keep the model's own masks"
    if experts:
        return "expert LoRA groups its rows by the routing of each pass"
    if not grouped:
        return "a slab whose dtype or strides grouped GEMM does not take (a per-run loop reads the host's runs)"
    if not varlen:
        return "no variable-length attention kernel: per-row attention reads the host's rows"
    return ""
