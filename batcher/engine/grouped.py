"""The pieces plain and expert LoRA share: grouped GEMM and when it applies, a pass's routes, a
layer's share of a split base, the slabs' rows and the context a pass's wrapped layers read.

`torch._grouped_mm` multiplies runs of rows, each by its own weight, in one kernel (float32 and
bfloat16, on the CPU and on Hopper GPUs); both `batcher.engine.multilora` (a run per adapter) and
`batcher.engine.expert_lora` (a group per expert and adapter) are built on it, and fall back to
batched matmuls or a loop where it does not apply.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

_HAS_GROUPED = hasattr(torch, "_grouped_mm")
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, *, offs: torch.Tensor) -> torch.Tensor:
    """`x[run g] @ weight[g]` for every run g of rows ending at `offs` (int32), in one kernel
    (public within the engine: the multi-LoRA layers and expert LoRA call it through here)."""
    out: torch.Tensor = torch._grouped_mm(x, weight, offs=offs)
    return out


@functools.cache
def grouped_gemm(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the grouped-GEMM path serves this dtype on this device (Hopper and later on CUDA)."""
    if not _HAS_GROUPED or dtype not in _GROUPED_DTYPES:
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (9, 0)
    return device.type == "cpu"


def groupable(x: torch.Tensor, *sizes: int) -> bool:
    """Grouped GEMM over these rows: the build has it for the dtype, and every stride the kernel
    reads (the `sizes`: ranks, widths, row counts) is a multiple of 16 bytes (a rank-4 bfloat16 slab
    is not)."""
    if not grouped_gemm(x.dtype, x.device):
        return False
    per = 16 // x.element_size()
    return all(n % per == 0 for n in sizes)


def compute_dtype(base_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The adapters' compute dtype: a half-precision GPU base's own (tensor cores, no conversion of
    the activations); float32 at least everywhere else."""
    if device.type == "cuda" and base_dtype in (torch.bfloat16, torch.float16):
        return base_dtype
    return torch.promote_types(base_dtype, torch.float32)


@dataclass
class Route:
    """One layer kind's routing for a pass: runs of flat tokens [start, end) and their slots (the
    slab's zero row for padding and non-targeting adapters). `offsets` and `slots` are the device
    copies (run ends, int32; slots, int64) the grouped path reads; `runs` is the host copy."""

    runs: tuple[tuple[int, int, int], ...]  # (slot, start, end)
    offsets: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    # The experts' LoRA (batcher.engine.expert_lora) groups by the pass's own adapters only: their slots
    # (`members`) and each run's index among them (`member_of_run`; len(members) for the zero row).
    members: torch.Tensor | None = None
    member_of_run: torch.Tensor | None = None
    # A captured pass's route (batcher.engine.graphs): a fixed number of runs (padded with empty ones in
    # the zero row), and nothing decided from `runs`, which are only the first pass's of its bucket.
    static: bool = False

    def membership(self, zero: int) -> tuple[list[int], list[int]]:
        """The host side of `members` and `member_of_run`, given the slab's zero row."""
        members = sorted({slot for slot, _, _ in self.runs if slot != zero})
        index = {slot: i for i, slot in enumerate(members)}
        return members, [index.get(slot, len(members)) for slot, _, _ in self.runs]

    def device(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(offsets, slots): the device copies, bound before the pass runs."""
        if self.offsets is None or self.slots is None:
            raise RuntimeError("a route's device copies are bound before its pass runs")
        return self.offsets, self.slots

    def members_on_device(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(members, member_of_run): the experts' device copies, bound before the pass runs."""
        if self.members is None or self.member_of_run is None:
            raise RuntimeError("an experts route's members are bound before its pass runs")
        return self.members, self.member_of_run

    @functools.cached_property
    def equal(self) -> bool:
        """Every run as long as the others: the tokens are a (runs, length) stack as they lie."""
        return len({e - s for _, s, e in self.runs}) == 1

    @functools.cached_property
    def member_of_token(self) -> torch.Tensor:
        """Each flat token's index among `members` (len(members): its adapter has no row here)."""
        offsets, _ = self.device()
        _, member_of_run = self.members_on_device()
        lengths = torch.diff(offsets.long(), prepend=offsets.new_zeros(1, dtype=torch.long))
        return torch.repeat_interleave(member_of_run, lengths, output_size=self.runs[-1][2])

    @functools.cached_property
    def block(self) -> int | None:
        """The first slot when the runs' slots are consecutive rows (a slice of the slab), else None."""
        first = self.runs[0][0]
        return first if all(slot == first + i for i, (slot, _, _) in enumerate(self.runs)) else None


def accumulate(grads: torch.Tensor, route: Route, per_run: torch.Tensor) -> None:
    """Add each run's gradient into its slot's row: a slice add when the slots are consecutive (the
    usual case: rows ordered by slot), index_add otherwise (a slot in several runs, gaps)."""
    first = None if route.static else route.block
    if first is not None:
        grads[first:first + per_run.shape[0]].add_(per_run.to(grads.dtype))
    else:
        grads.index_add_(0, route.device()[1], per_run.to(grads.dtype))


@dataclass(frozen=True)
class Split:
    """A layer's share of a tensor-parallel base, and so of its LoRA: "out" (column parallel: the
    output rows `[index * n / count, (index + 1) * n / count)` of the weight and of B), "in" (row
    parallel: those input columns of the weight and of A) or "experts" (expert parallel: those
    experts, and their A and B; `batcher.engine.expert_lora`)."""

    dim: str  # "out" | "in" | "experts"
    index: int
    count: int
    group: dist.ProcessGroup | None = None  # the tensor-parallel process group
    # its 1-D device mesh (a snapshot's shares are DTensors over it: batcher.engine.sharded_snapshots)
    mesh: DeviceMesh | None = None

    def axis(self, which: str) -> int | None:
        """The axis along which the layer's `which` ("A" [rank, in] or "B" [out, rank]; an experts
        part's [E, rank, in] and [E, out, rank]) is split."""
        if self.dim == "experts":
            return 0
        if which == "A":
            return 1 if self.dim == "in" else None
        return 0 if self.dim == "out" else None

    def local(self, full: torch.Tensor, axis: int | None) -> torch.Tensor:
        """This rank's share of a whole tensor."""
        if axis is None:
            return full
        size = full.shape[axis] // self.count
        return full.narrow(axis, self.index * size, size)

    def gather(self, part: torch.Tensor, axis: int | None) -> torch.Tensor:
        """The whole tensor from every rank's share (a collective: every rank of the group calls it)."""
        if axis is None:
            return part
        parts = [torch.empty_like(part) for _ in range(self.count)]
        dist.all_gather(parts, part.contiguous(), group=self.group)
        return torch.cat(parts, dim=axis)

    def all_reduce(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, group=self.group)


def tp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The tensor-parallel axis of a device mesh, as a 1-D mesh."""
    return mesh["tp"] if mesh.ndim > 1 else mesh


class PassContext:
    """What the wrapped layers read during a pass: a route per (target name, rank), and per (group
    of siblings, rank) the shrink of their shared input, kept until every sibling has read it.
    Setting the routes (a new pass, the next head chunk, the end of a pass) forgets the shrinks."""

    def __init__(self) -> None:
        self._routes: dict[tuple[str, int], Route] | None = None
        self.shrunk: dict[tuple[object, int], Shrunk] = {}

    @property
    def routes(self) -> dict[tuple[str, int], Route] | None:
        return self._routes

    @routes.setter
    def routes(self, routes: dict[tuple[str, int], Route] | None) -> None:
        self._routes = routes
        self.shrunk.clear()


@dataclass
class Shrunk:
    x: torch.Tensor  # the input it was taken of (held, so its identity stays its own)
    parts: tuple[torch.Tensor, ...]  # one [tokens, rank] per sibling
    taken: set[int] = field(default_factory=set)


@dataclass
class Slab:
    A: torch.Tensor  # [slots + 1, rank, in], master dtype (a view of its group's shrink tensor, `multilora.SharedA.A`)
    B: torch.Tensor  # [slots + 1, out, rank]
    gA: torch.Tensor
    gB: torch.Tensor
    A_c: torch.Tensor  # compute copies (the masters themselves unless the compute dtype differs)
    B_c: torch.Tensor
    scale: float

    @property
    def zero_slot(self) -> int:
        return self.A.shape[0] - 1
