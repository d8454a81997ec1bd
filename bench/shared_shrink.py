"""What siblings sharing one shrink buys (batcher.engine.multilora.Siblings: q/k/v one GEMM, gate/up one):
two trainers over two copies of one random base, side by side in one run.

  shared  q/k/v and gate/up each share one shrink of their input (the trainer as it runs),
  alone   every layer shrinks its input by itself (`LoraBackend(shared_shrinks=False)`: the layer
          before the change, arithmetic and all).

For each (tenants N, tokens T per tenant), one training pass of each trainer, interleaved
(median of each repetition's ratio; eager passes, and on a GPU replayed ones too); per pass, the
operators the host issues (the kernels it launches, on a GPU), the bytes autograd keeps for the
backward (saved tensors other than the base's weights, each storage once) and on a GPU the peak
memory; and the largest difference between the two trainers' logprobs.

Which regime favours sharing: a bfloat16 base on the CPU, whose adapters compute in float32 (each
layer converts its input, shared once per group and alone once per layer, and keeps that copy for
the backward), and passes whose time is launches (small passes on a GPU, run eagerly). Which does
not: a float32 base (the conversion copies nothing) and replayed CUDA graphs (a launch costs nothing
there): the GEMMs' FLOPs are the same either way, what is left is reading the input once rather than
two or three times.

    python bench/shared_shrink.py [--dtype bfloat16]
    python bench/shared_shrink.py --device cuda --dtype bfloat16 --shape 1.6b     (bench/gpu_suite.sh)

Ends with one JSON line of headline figures.
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import json
import statistics
import tempfile
from pathlib import Path

import torch
from fused_step import SHAPES, build, datum, eagerly, grid_parser, interleaved, launches, requests, run  # noqa: E402

from batcher.engine.backend import LoraBackend  # noqa: E402
from core.work import LoraShape  # noqa: E402


def kept_bytes(be: LoraBackend, fn) -> int:
    """Bytes of the tensors autograd saves for the backward while fn() runs, each storage counted
    once, the base's own weights left out (both trainers keep those alike)."""
    weights = {p.untyped_storage().data_ptr() for p in be.base.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def peak_mib(device: torch.device, fn) -> float | None:
    """The device memory fn() allocates at its peak above what was allocated before (GPU only)."""
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def agreement(trainers: dict[str, LoraBackend], vocab: int, tenants: int) -> float:
    """Largest |shared - alone| logprob over up to 4 tenants' sequences of different lengths."""
    work = [(f"t{i}", [datum(90 + i, 17 + 13 * i, vocab)]) for i in range(min(4, tenants))]
    shared, alone = (be.run_pass(requests(work, forward_only=True)) for be in trainers.values())
    worst = 0.0
    for a, b in zip(shared, alone):
        assert isinstance(a, dict) and isinstance(b, dict), (a, b)
        x, y = (o["loss_fn_outputs"][0]["logprobs"]["data"] for o in (a, b))
        worst = max(worst, max(abs(p - q) for p, q in zip(x, y)))
    return worst


def one_pass(be: LoraBackend, work, path: str):
    """A training pass of `work` on `be`: eagerly, or replayed from its bucket's graph (on a GPU)."""
    if path == "replayed":
        return lambda: run(be, work)
    return lambda: eagerly(be, lambda: run(be, work))


def measure(trainers: dict[str, LoraBackend], device, work, path: str, reps: int, unit: str) -> dict:
    times = interleaved(device, {key: one_pass(be, work, path) for key, be in trainers.items()}, reps)
    row = {"alone_over_shared": statistics.median(a / s for s, a in zip(times["shared"], times["alone"])),
           "shared_ms": statistics.median(times["shared"]) * 1e3, "alone_ms": statistics.median(times["alone"]) * 1e3}
    for key, be in trainers.items():
        row[f"{unit}_{key}"] = launches(device, one_pass(be, work, path))
        # (a replay runs no Python autograd: what it keeps shows in the peak)
        row[f"kept_mib_{key}"] = kept_bytes(be, one_pass(be, work, path)) / 2**20 if path == "eager" else None
        row[f"peak_mib_{key}"] = peak_mib(device, one_pass(be, work, path))
    return row


def mib(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def main() -> None:
    args = grid_parser(__doc__, SHAPES, tenants="1,8", tokens="64,256", reps=5, rank=16).parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    tenants, tokens = args.tenants, args.tokens
    vocab = SHAPES[args.shape][-1]

    with tempfile.TemporaryDirectory() as tmp:
        trainers: dict[str, LoraBackend] = {}
        for key, shared in (("shared", True), ("alone", False)):
            directory = Path(tmp) / key
            model, params = build(args.shape, device, dtype, directory)  # seeded: both bases are one base
            be = trainers[key] = LoraBackend(directory, device=args.device, dtype=dtype, model=model,
                                             max_resident=max(tenants), shared_shrinks=shared)
            for i in range(max(tenants)):
                be.create(f"t{i}", LoraShape(rank=args.rank, seed=i))
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        paths = ("eager", "replayed") if device.type == "cuda" else ("eager",)
        unit = "kernels" if device.type == "cuda" else "operators"
        print(f"{name}: random Qwen3 '{args.shape}', {params / 1e6:,.0f} M matmul parameters, {args.dtype}, "
              f"LoRA rank {args.rank} on every projection and lm_head; adapters compute in "
              f"{trainers['shared'].lora.compute_dtype}\n")
        print(f"{'tenants':>7} {'tokens':>6} {'path':>8} {'alone/shared':>12} {'shared ms':>10} "
              f"{unit + ' shared':>17} {'alone':>7} {'kept MiB shared':>16} {'alone':>7} {'peak MiB':>15}")
        grid = {}
        for n in tenants:
            for t in tokens:
                work = [(f"t{i}", [datum(1000 * i + t, t, vocab)]) for i in range(n)]
                for path in paths:
                    row = grid[f"{n}x{t} {path}"] = measure(trainers, device, work, path, args.reps, unit)
                    peaks = (f"{row['peak_mib_shared']:.0f} / {row['peak_mib_alone']:.0f}"
                             if row["peak_mib_shared"] is not None else "-")
                    print(f"{n:>7} {t:>6} {path:>8} {row['alone_over_shared']:>12.3f} {row['shared_ms']:>10.1f} "
                          f"{row[f'{unit}_shared']:>17} {row[f'{unit}_alone']:>7} {mib(row['kept_mib_shared']):>16} "
                          f"{mib(row['kept_mib_alone']):>7} {peaks:>15}")
        worst = agreement(trainers, vocab, max(tenants))
        print(f"\nshared against alone, largest logprob difference: {worst:.2e}")

    print(json.dumps({
        "device": name, "shape": args.shape, "dtype": args.dtype, "rank": args.rank,
        "grid": {k: {kk: round(vv, 4) if isinstance(vv, float) else vv for kk, vv in v.items()}
                 for k, v in grid.items()},
        "shared_vs_alone": worst,
    }))


if __name__ == "__main__":
    main()
