"""Long rows: peak memory of one training pass over a single row of 16K, 32K and 131K tokens, each
layer checkpointed (batcher.engine.recompute) or not, per token.

At a real base's shape (`--meta-shape`, Qwen3-8B by default) the pass runs on PyTorch's meta device
(bench/gpu_dryrun.py: the trainer's own pass, its live tensors tracked, no memory or GPU needed):
its tracked peak beside the adapters, per token, and what the memory plan says. On the CPU each
(tokens, checkpointed) case runs in a process of its own, which reports its resident memory
before the pass (the base, one adapter, torch) and its peak resident memory after it (`ru_maxrss`):
the difference is what the pass itself needed. The ratio per token at every length shows whether
memory grows linearly with the row (a constant MiB per token) and what checkpointing saves beside
the uncheckpointed pass at the same lengths.

The CPU's model is the tiny Qwen3 of the test stack narrowed so that a long row's attention (a square
in the row's length) finishes at all on two CPU cores: `--layers` decoder layers (default 1) of one
32-wide query head and one key/value head; its hidden, MLP and vocabulary sizes are the tiny base's.
With one layer, checkpointing has little to save there (the one layer's replay is what the plain
pass keeps); the CPU rows show memory linear in the row, the meta rows what checkpointing saves.

    python bench/long_context.py                     # meta: 8B at 16K, 32K, 131K; CPU: 16K; each both ways
    python bench/long_context.py --tokens 16384,32768,131072   # the CPU's long rows too (the 131K: most of an hour)

Ends with one JSON line.
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

MiB = 2**20


def _rss() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize()


def one(tokens: int, checkpointed: bool, layers: int, cache: Path) -> dict[str, float]:
    """One pass over a single row of `tokens`, in this process; its memory figures."""
    import torch

    from batcher.engine.backend import LoraBackend
    from batcher.engine.protocol import PassRequest
    from core.loss_spec import LossConfig
    from core.work import Datum, LoraShape, PassWork
    from stack.tiny_model import TinyModelSpec, build_tiny_model

    torch.set_num_threads(2)
    spec = TinyModelSpec(num_layers=layers, num_attention_heads=1, num_key_value_heads=1, head_dim=32)
    path = build_tiny_model(cache / f"narrow-{layers}", spec=spec).path
    # the head in chunks of 4,096 tokens at every length (one chunk within its budget keeps its logits)
    be = LoraBackend(path, max_tokens_per_pass=tokens, pack_width=tokens, head_chunk_tokens=4096,
                     checkpoint_tokens=1 if checkpointed else 0)
    be.create("a", LoraShape(rank=8, seed=0))
    ids = tuple((i * 7919) % 1000 + 3 for i in range(tokens + 1))
    datum = Datum(ids[:-1], {"target_tokens": ids[1:], "weights": (1.0,) * tokens})
    request = PassRequest("a", "a", PassWork("cross_entropy", LossConfig(), (datum,)), False)
    before = _rss()
    started = time.perf_counter()
    out = be.run_pass([request])[0]
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    grads = sum(float(p.grad.abs().sum()) for p in be.adapters["a"].params)
    return {"tokens": tokens, "checkpointed": checkpointed, "before_mib": before / MiB, "peak_mib": peak / MiB,
            "pass_mib": (peak - before) / MiB, "kib_per_token": (peak - before) / tokens / 1024,
            "seconds": round(seconds, 1), "loss": float(out["metrics"]["loss:sum"]), "grad_abs_sum": grads}


def tracked(shape: str, tokens: int, checkpoint_tokens: int) -> dict[str, float]:
    """One row of `tokens` on a real base's shape on the meta device (bench/gpu_dryrun.py): the
    pass's tracked peak beside the adapters and their AdamW state."""
    import gpu_dryrun

    r = gpu_dryrun.dry_run(shape, tenants=1, tokens=tokens, rank=32, checkpoint_tokens=checkpoint_tokens)
    gib = r["tracked_gib"]["pass peak"] - r["tracked_gib"]["adapters and AdamW"]
    return {"tokens": tokens, "checkpointed": checkpoint_tokens > 0, "pass_gib": round(gib, 2),
            "kib_per_token": round(gib * 2**30 / tokens / 1024, 1), "plan_gib_per_rank": r["plan_peak_gib_per_rank"]}


def _spread(rows: list[dict[str, float]]) -> float:
    per_token = [r["kib_per_token"] for r in rows]
    return round(max(per_token) / min(per_token), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meta-shape", default="8b", help="a bench/gpu_dryrun.py shape tracked on the meta device")
    parser.add_argument("--meta-tokens", default="16384,32768,131072")
    parser.add_argument("--tokens", default="16384", help="row lengths on the CPU, checkpointed and not")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--cache", default="/tmp/quilt-bench-long-context")
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)  # "tokens,checkpointed": the child
    args = parser.parse_args()
    if args.one:
        tokens, ck = args.one.split(",")
        print(json.dumps(one(int(tokens), ck == "1", args.layers, Path(args.cache))))
        return
    meta = []
    for tokens in [int(t) for t in args.meta_tokens.split(",") if t]:
        for ck in (8192, 0):
            r = tracked(args.meta_shape, tokens, ck)
            meta.append(r)
            print(f"{args.meta_shape} on meta {tokens:>8,} tokens {'checkpointed' if ck else 'plain       '}: pass peak "
                  f"{r['pass_gib']:9.2f} GiB ({r['kib_per_token']:8.1f} KiB/token; the plan's rank peak "
                  f"{r['plan_gib_per_rank']:,.2f} GiB)", flush=True)
    cpu = []
    for tokens in [int(t) for t in args.tokens.split(",") if t]:
        for ck in (True, False):
            done = subprocess.run([sys.executable, __file__, "--one", f"{tokens},{int(ck)}", "--layers",
                                   str(args.layers), "--cache", args.cache], capture_output=True, text=True, check=True)
            r = json.loads(done.stdout.strip().splitlines()[-1])
            cpu.append(r)
            print(f"CPU {tokens:>8,} tokens {'checkpointed' if ck else 'plain       '}: pass {r['pass_mib']:9.1f} MiB "
                  f"({r['kib_per_token']:6.2f} KiB/token), before {r['before_mib']:7.1f} MiB, {r['seconds']:7.1f} s",
                  flush=True)
    summary: dict[str, object] = {}
    for name, rows in (("meta", meta), ("cpu", cpu)):
        ck = [r for r in rows if r["checkpointed"]]
        plain = {r["tokens"]: r for r in rows if not r["checkpointed"]}
        if len(ck) > 1:
            summary[f"{name}_checkpointed_per_token_spread"] = _spread(ck)
            print(f"{name}: checkpointed KiB/token, largest over smallest across lengths: {_spread(ck):.3f} (1 = linear)")
        summary[f"{name}_plain_over_checkpointed"] = {
            r["tokens"]: round(plain[r["tokens"]]["kib_per_token"] / r["kib_per_token"], 2) for r in ck
            if r["tokens"] in plain}
        print(f"{name}: plain over checkpointed at the same length: {summary[f'{name}_plain_over_checkpointed']}")
    print(json.dumps({"meta_shape": args.meta_shape, "layers": args.layers, "meta": meta, "cpu": cpu, **summary}))


if __name__ == "__main__":
    main()
