"""The fused step at the device's pace: tokens/s and MFU of Quilt's fused pass over a grid of tenants
and tokens per tenant, against one adapter over the same rows and against one tenant at a time.

For each (tenants N, tokens T), every tenant brings one sequence of T tokens, measured interleaved:
  fused       one forward/backward for all N adapters (the trainer's pass: on a GPU, replayed from
              the CUDA graph of its bucket, batcher.engine.graphs),
  eager       the same pass run eagerly (QUILT_TRAINER_CUDA_GRAPHS off),
  one-adapter one adapter over all N sequences (no routing: what fusion can at best reach),
  sequential  one pass per tenant, one after another (what a single-tenant trainer does), each
              replayed from its own graph like the fused pass: the fair baseline.
Ratios are medians of each repetition's own ratio. MFU counts 4·P·T per trained token (forward
2PT, backward to the activations 2PT; the frozen base's weight gradients are never computed; P the
parameters of the matmuls, attention's own FLOPs left out, which understates MFU at 512 tokens by a
few percent) against the spec (989 TFLOP/s bf16 dense for an H200/H100 SXM) and against a large
matmul measured in the same run.

Then: a round's optimizer steps for each tenant count, taken together (one norm read-back, one
AdamW call per set of hyperparameters) against one model at a time; one pass of 8 x 64 tokens
profiled, replayed and eager (kernel launches, the device's busy
fraction, the top kernels), both paths checked for host synchronisation
(`torch.cuda.set_sync_debug_mode("error")`), and the fused logprobs checked against the tenants'
passes alone.

Which regime favours fusion: small per-tenant batches on a large device (64 tokens on an 8B base
leaves an H200 mostly idle); which does not: per-tenant batches that already fill it (512+ tokens),
where fusion only adds routing. Graphs pay where launches dominate (small passes, small bases) and
cost up to half again a pass's tokens in bucket padding (none in this grid: every pass's tokens are
a bucket's width).

    python bench/fused_step.py --shape tiny [--emulate-graphs]               (CPU smoke run)
    python bench/fused_step.py --device cuda --dtype bfloat16 --shape 8b     (bench/gpu_suite.sh)

Ends with one JSON line of headline figures.
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from batcher.engine.backend import LoraBackend
from batcher.engine.protocol import PassRequest
from core.loss_spec import LossConfig
from core.work import AdamParams, Datum, LoraShape, PassWork

SPEC_TFLOPS = {"bfloat16": 989.0, "float32": 67.0}  # H200/H100 SXM dense spec sheet (float32: no tensor cores)
SHAPES = {  # Qwen3 shapes: hidden, layers, heads, kv heads, head dim, MLP width, vocabulary
    "tiny": (256, 4, 4, 2, 64, 768, 4096),
    "1.6b": (4096, 8, 64, 32, 64, 12288, 8192),  # bench/trainer_fusion.py's GPU shape (1.64 B parameters)
    "8b": (4096, 36, 32, 8, 128, 12288, 151936),  # Qwen3-8B
}


def build(shape: str, device: torch.device, dtype: torch.dtype, directory: Path) -> tuple[torch.nn.Module, int]:
    """A random-weight Qwen3 of the shape, made on the device (no weights file): (model, matmul params)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hidden, layers, heads, kv, head_dim, mlp, vocab = SHAPES[shape]
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, head_dim=head_dim, intermediate_size=mlp,
                         max_position_embeddings=8192, tie_word_embeddings=False)
    config.save_pretrained(directory)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    embed = model.get_input_embeddings().weight.numel()
    return model.eval(), sum(p.numel() for p in model.parameters()) - embed


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_peak(device: torch.device, dtype: torch.dtype, seconds: float = 1.0) -> float:
    n = 8192 if device.type == "cuda" else 1024
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    torch.mm(a, b)
    sync(device)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        count += 1
    sync(device)
    return 2 * n**3 * count / (time.perf_counter() - start)


def datum(seed: int, n: int, vocab: int) -> Datum:
    g = torch.Generator().manual_seed(seed)
    toks = tuple(torch.randint(0, vocab, (n + 1,), generator=g).tolist())
    return Datum(toks[:-1], {"target_tokens": toks[1:], "weights": (1.0,) * n})


def requests(work: list[tuple[str, list[Datum]]], forward_only: bool = False) -> list[PassRequest]:
    return [PassRequest(f"r{i}", m, PassWork("cross_entropy", LossConfig(), tuple(d)), forward_only)
            for i, (m, d) in enumerate(work)]


def run(be: LoraBackend, work: list[tuple[str, list[Datum]]]) -> None:
    outs = be.run_pass(requests(work))
    assert all(isinstance(o, dict) for o in outs), outs
    for model_id, _ in work:  # gradients would accumulate; the bench measures passes
        be.lora.clear_grads(be.adapters[model_id].name)


def timed(device: torch.device, fn) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def interleaved(device, modes: dict, reps: int) -> dict[str, list[float]]:
    """Each mode once to warm up, then `reps` rounds of every mode in turn: seconds per mode."""
    for fn in modes.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in modes}
    for _ in range(reps):
        for k, fn in modes.items():
            times[k].append(timed(device, fn))
    return times


def eagerly(be: LoraBackend, fn) -> None:
    """fn() with the backend's CUDA graphs off."""
    be.planner.cuda_graphs = False
    try:
        fn()
    finally:
        be.planner.cuda_graphs = True


def measure(be: LoraBackend, device, n: int, tokens: int, reps: int, vocab: int, sequential: bool) -> dict:
    work = [(f"t{i}", [datum(1000 * i + tokens, tokens, vocab)]) for i in range(n)]
    modes = {"fused": lambda: run(be, work),
             "eager": lambda: eagerly(be, lambda: run(be, work)),
             "one_adapter": lambda: run(be, [("t0", [d for _, ds in work for d in ds])])}
    if sequential:
        modes["sequential"] = lambda: [run(be, [w]) for w in work]
    times = interleaved(device, modes, reps)
    ratio = {k: statistics.median(f / t for f, t in zip(times["fused"], v)) for k, v in times.items()}
    return {"seconds": {k: statistics.median(v) for k, v in times.items()},
            "fused_over": {k: 1 / r for k, r in ratio.items() if k != "fused"}}


def profile(be: LoraBackend, device, vocab: int, graphs: bool = True) -> dict:
    """One 8 x 64 pass under torch.profiler: kernels launched, the device's busy fraction, top kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    work = [(f"t{i}", [datum(7 + i, 64, vocab)]) for i in range(8)]
    one = (lambda: run(be, work)) if graphs else (lambda: eagerly(be, lambda: run(be, work)))
    one()
    one()  # a bucket's first pass warms it, the second captures it: the profiled one replays
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        wall = timed(device, one)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.device_time for e in kernels) if kernels else 0.0
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time)
    top = sorted(((sum(v), len(v), k) for k, v in by_name.items()), reverse=True)[:8]
    return {"wall_ms": wall * 1e3, "kernels": len(kernels), "busy_ms": busy_us / 1e3,
            "busy_fraction": busy_us / 1e6 / wall if wall else 0.0,
            "top": [{"kernel": k[:90], "ms": round(t / 1e3, 3), "count": c} for t, c, k in top]}


def sync_check(be: LoraBackend, device, vocab: int, graphs: bool = True) -> str:
    """'none' when a whole pass's device work (forward, losses, backward; a replay where `graphs`)
    never waits for the device."""
    if device.type != "cuda":
        return "not checked (no CUDA device)"
    be.planner.cuda_graphs = graphs
    reqs = requests([(f"t{i}", [datum(50 + i, 40 + 8 * i, vocab), datum(60 + i, 24, vocab)]) for i in range(4)])
    be.run_pass(reqs)  # first calls may initialise (and synchronise) once; a bucket's first warms it
    be.run_pass(reqs)  # and its second captures it (a capture synchronises)
    device_work = be.planned_pass(reqs)
    torch.cuda.set_sync_debug_mode("error")
    try:
        device_work()
        return "none"
    except RuntimeError as exc:
        return f"synchronised: {str(exc).splitlines()[0][:160]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
        be.planner.cuda_graphs = True
        for r in reqs:
            be.lora.clear_grads(be.adapters[r.model_id].name)


def agreement(be: LoraBackend, vocab: int) -> float:
    """Largest |fused - alone| logprob over 4 tenants' sequences of different lengths."""
    work = [(f"t{i}", [datum(90 + i, 17 + 13 * i, vocab)]) for i in range(4)]
    fused = be.run_pass(requests(work, forward_only=True))
    worst = 0.0
    for (m, d), f in zip(work, fused):
        [alone] = be.run_pass(requests([(m, d)], forward_only=True))
        a, b = (o["loss_fn_outputs"][0]["logprobs"]["data"] for o in (f, alone))
        worst = max(worst, max(abs(x - y) for x, y in zip(a, b)))
    return worst


def optimizer_round(be: LoraBackend, device, n: int, reps: int) -> dict:
    """A round's optimizer steps of n models, taken together (batcher.engine.optimizers, what the trainer
    does) against one model at a time: milliseconds per round, and the kernels one round launches
    (on the CPU, the operators the host issues)."""
    adam = AdamParams(learning_rate=1e-5, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0)
    models = [f"t{i}" for i in range(n)]

    def gradients() -> None:
        for m in models:
            name = be.adapters[m].name
            be.lora.set_grads(name)
            for p in be.adapters[m].params:
                p.grad.normal_()

    def step(together: bool):
        gradients()
        sync(device)
        start = time.perf_counter()
        if together:
            outs = be.optim_steps([(m, adam) for m in models])
        else:
            outs = [be.optim_steps([(m, adam)])[0] for m in models]
        sync(device)
        assert all(isinstance(o, dict) for o in outs), outs
        return time.perf_counter() - start

    step(True)  # first steps make each model's AdamW state
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(reps):
        for together in (True, False):
            times[together].append(step(together))
    counts = {}
    for together in (True, False):
        gradients()
        counts[together] = launches(device, lambda: be.optim_steps([(m, adam) for m in models]) if together
                                    else [be.optim_steps([(m, adam)]) for m in models])
    together, apart = statistics.median(times[True]), statistics.median(times[False])
    return {"together_ms": together * 1e3, "one_by_one_ms": apart * 1e3, "speedup": apart / together,
            "launches_together": counts[True], "launches_one_by_one": counts[False]}


def launches(device: torch.device, fn) -> int:
    """The kernels fn() launches on a GPU; on the CPU, the operators the host issues (top-level aten
    calls, each at least one launch on a GPU; their CPU kernels' inner calls not counted)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        fn()
        sync(device)
    if device.type == "cuda":
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and (
        e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


def guarded(fn, failed):
    """fn(), or `failed` carrying the error (a dict gains an 'error' key; a string becomes it)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a diagnostic must not cost the table above it
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        if isinstance(failed, dict):
            return {**failed, "error": error}
        return error if isinstance(failed, str) else failed


def grid_parser(doc: str, shapes: dict, *, tenants: str, tokens: str, reps: int, rank: int) -> argparse.ArgumentParser:
    """The arguments of a bench over a grid of tenants x tokens per tenant on a random base (this one,
    bench/expert_lora.py, bench/shared_shrink.py); `--tenants` and `--tokens` parse to lists."""
    def counts(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(shapes), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tenants", type=counts, default=counts(tenants))
    parser.add_argument("--tokens", type=counts, default=counts(tokens), help="tokens per tenant")
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--rank", type=int, default=rank)
    return parser


def main() -> None:
    parser = grid_parser(__doc__, SHAPES, tenants="1,8,16,64", tokens="64,256,512", reps=3, rank=32)
    parser.add_argument("--budget", type=int, default=4096, help="tokens per micro-batch (activation memory)")
    parser.add_argument("--sequential-up-to", type=int, default=64, help="skip the sequential column above this")
    parser.add_argument("--emulate-graphs", action="store_true",
                        help="take the captured path's buckets on the CPU too (replays run the step again)")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    tenants, tokens = args.tenants, args.tokens
    vocab = SHAPES[args.shape][-1]

    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        model, params = build(args.shape, device, dtype, Path(tmp))
        # max_resident: slabs sized for exactly the tenants (no doubling past them)
        be = LoraBackend(tmp, device=args.device, dtype=dtype, max_tokens_per_pass=args.budget, model=model,
                         max_resident=max(tenants), emulate_graphs=args.emulate_graphs)
        for i in range(max(tenants)):
            be.create(f"t{i}", LoraShape(rank=args.rank, seed=i))
        peak = matmul_peak(device, dtype)
        spec = SPEC_TFLOPS[args.dtype] * 1e12 if device.type == "cuda" else peak
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"{name}: random Qwen3 '{args.shape}', {params / 1e6:,.0f} M matmul parameters, {args.dtype}, "
              f"LoRA rank {args.rank} on every projection and lm_head; built in {time.perf_counter() - started:.0f} s")
        print(f"matmul peak measured now: {peak / 1e12:.1f} TFLOP/s; spec used for MFU: {spec / 1e12:.0f} TFLOP/s\n")
        print(f"{'tenants':>7} {'tokens':>6} {'fused tok/s':>12} {'MFU spec':>9} {'MFU peak':>9} "
              f"{'fused/1-adapter':>16} {'fused/seq':>10} {'graph/eager':>12} {'pass ms':>8}")
        grid = {}
        for n in tenants:
            for t in tokens:
                m = measure(be, device, n, t, args.reps, vocab, n <= args.sequential_up_to)
                s = m["seconds"]["fused"]
                flops = 4 * params * n * t / s
                row = {"tokens_per_s": n * t / s, "mfu_spec": flops / spec, "mfu_peak": flops / peak,
                       "fused_over_one_adapter": m["fused_over"]["one_adapter"],
                       "fused_over_sequential": m["fused_over"].get("sequential"),
                       "graph_over_eager": m["fused_over"]["eager"], "pass_ms": s * 1e3,
                       "eager_pass_ms": m["seconds"]["eager"] * 1e3}
                grid[f"{n}x{t}"] = row
                seq = f"{row['fused_over_sequential']:.2f}" if row["fused_over_sequential"] else "-"
                print(f"{n:>7} {t:>6} {row['tokens_per_s']:>12.0f} {row['mfu_spec']:>9.1%} {row['mfu_peak']:>9.1%} "
                      f"{row['fused_over_one_adapter']:>16.2f} {seq:>10} {row['graph_over_eager']:>12.2f} "
                      f"{row['pass_ms']:>8.1f}")
        # The checks after the table report their own failure instead of losing the table.
        profiles = {}
        for path, graphs in (("replayed", True), ("eager", False)):
            prof = profiles[path] = guarded(lambda: profile(be, device, vocab, graphs), {})
            if "wall_ms" in prof:
                print(f"\none 8 x 64 pass, {path}: {prof['wall_ms']:.1f} ms wall, {prof['kernels']} kernels, "
                      f"device busy {prof['busy_ms']:.1f} ms ({prof['busy_fraction']:.0%})")
                for k in prof["top"]:
                    print(f"  {k['ms']:>8.3f} ms  x{k['count']:<5} {k['kernel']}")
            else:
                print(f"\nprofile ({path}) failed: {prof.get('error')}")
        rounds = {}
        print("\na round's optimizer steps, together against one model at a time:")
        for n in tenants:
            r = rounds[str(n)] = guarded(lambda: optimizer_round(be, device, n, args.reps), {})
            if "speedup" in r:
                unit = "kernels" if device.type == "cuda" else "operators"
                print(f"  {n:>3} models: {r['together_ms']:8.1f} ms against {r['one_by_one_ms']:8.1f} ms "
                      f"({r['speedup']:.2f}x), {r['launches_together']} {unit} against {r['launches_one_by_one']}")
            else:
                print(f"  {n:>3} models: failed: {r.get('error')}")
        syncs = {path: guarded(lambda: sync_check(be, device, vocab, graphs), "")
                 for path, graphs in (("replayed", True), ("eager", False))}
        worst = guarded(lambda: agreement(be, vocab), float("nan"))
        print(f"host synchronisation inside a pass: {syncs}")
        print(f"fused vs alone, largest logprob difference: {worst:.2e}")
        print(f"graphs: {dict(be.graphs.counts)}")
        memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        if memory is not None:
            print(f"device memory at most {memory:.1f} GiB allocated")

    print(json.dumps({
        "device": name, "shape": args.shape, "dtype": args.dtype, "params": params,
        "peak_tflops": round(peak / 1e12, 1),
        "grid": {k: {kk: round(vv, 4) if isinstance(vv, float) else vv for kk, vv in v.items()}
                 for k, v in grid.items()},
        "profile_8x64": {path: {k: v for k, v in p.items() if k != "top"} for path, p in profiles.items()},
        "syncs": syncs, "fused_vs_alone": worst, "graphs": dict(be.graphs.counts), "max_memory_gib": memory,
        "optimizer_round": {n: {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
                            for n, r in rounds.items()},
    }))


if __name__ == "__main__":
    main()
