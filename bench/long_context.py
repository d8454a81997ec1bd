"""Long rows on the CPU: peak memory of one training pass over a single row of 16K, 32K and 131K tokens,
each layer checkpointed (batcher.engine.recompute) or not, per token.

Each (tokens, checkpointed) case runs in a process of its own, which reports its resident memory
before the pass (the base, one adapter, torch) and its peak resident memory after it (`ru_maxrss`):
the difference is what the pass itself needed. The ratio per token at every length shows whether
memory grows linearly with the row (a constant MiB per token) and what checkpointing saves beside
the uncheckpointed pass at the same lengths.

The model is the tiny Qwen3 of the test stack narrowed so that the 131K row's attention (a square in
the row's length) finishes in minutes on two CPU cores: `--layers` decoder layers (default 1) of one
32-wide query head and one key/value head; its hidden, MLP and vocabulary sizes are the tiny base's.

    python bench/long_context.py                     # 16K, 32K, 131K checkpointed; 16K, 32K not
    python bench/long_context.py --tokens 16384,32768 --plain 16384

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="16384,32768,131072", help="row lengths, checkpointed")
    parser.add_argument("--plain", default="16384,32768", help="row lengths, not checkpointed (beside them)")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--cache", default="/tmp/quilt-bench-long-context")
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)  # "tokens,checkpointed": the child
    args = parser.parse_args()
    if args.one:
        tokens, ck = args.one.split(",")
        print(json.dumps(one(int(tokens), ck == "1", args.layers, Path(args.cache))))
        return
    cases = [(int(t), True) for t in args.tokens.split(",") if t] + [(int(t), False) for t in args.plain.split(",") if t]
    results = []
    for tokens, ck in cases:
        done = subprocess.run([sys.executable, __file__, "--one", f"{tokens},{int(ck)}", "--layers", str(args.layers),
                               "--cache", args.cache], capture_output=True, text=True, check=True)
        r = json.loads(done.stdout.strip().splitlines()[-1])
        results.append(r)
        print(f"{tokens:>8,} tokens {'checkpointed' if ck else 'plain       '}: pass {r['pass_mib']:9.1f} MiB "
              f"({r['kib_per_token']:6.2f} KiB/token), before {r['before_mib']:7.1f} MiB, {r['seconds']:7.1f} s",
              flush=True)
    ck = [r for r in results if r["checkpointed"]]
    per_token = {r["tokens"]: r["kib_per_token"] for r in ck}
    linear = max(per_token.values()) / min(per_token.values()) if per_token else None
    saved = {r["tokens"]: round(r["pass_mib"] / next(c["pass_mib"] for c in ck if c["tokens"] == r["tokens"]), 2)
             for r in results if not r["checkpointed"] and any(c["tokens"] == r["tokens"] for c in ck)}
    print(f"checkpointed KiB/token, largest over smallest across lengths: {linear:.2f} (1.00 = linear)")
    print(f"plain over checkpointed pass memory at the same length: {saved}")
    print(json.dumps({"layers": args.layers, "cases": results, "per_token_spread": linear, "plain_over_checkpointed": saved}))


if __name__ == "__main__":
    main()
