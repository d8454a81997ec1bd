"""Peak memory of a merged-model download: the streamed merge against building every delta first.

A merged download (GET .../merged.tar, `quilt export --merge`) writes the base's safetensors with
each LoRA-wrapped weight replaced by W + scaling * B @ A. Two ways, each run in a fresh process
that streams the whole merged model to nowhere and reports its peak RSS (ru_maxrss):

  streamed  checkpoints.adapter_merge as it is: the adapter's low-rank factors stay in memory and
            each weight's dense float32 delta is computed when that weight is written, then dropped;
  eager     the way it was before (and what a simple script does): every dense float32 delta
            built up front, then the same stream.

The model is synthetic (random bf16 weights written as safetensors, no transformers model): L
layers of q/k/v/o/gate/up/down projections of width H, all wrapped by a rank-r adapter. Its dense
deltas alone are 4 bytes x every wrapped weight (1.8 GiB by default), past the API pod's 1 GiB
limit (deploy/k8s); the streamed peak is the process's baseline (torch, safetensors) plus about one
layer's largest weight in a few float32 copies. Which regime favours streaming: large bases, many
wrapped modules; which does not: a tiny base, where the baseline dominates both.

    python bench/merge_memory.py [--layers 12 --hidden 2048 --rank 16] [--quick]

Ends with one JSON line of headline figures.
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = {"self_attn.q_proj": (1, 1), "self_attn.k_proj": (1, 1), "self_attn.v_proj": (1, 1),
           "self_attn.o_proj": (1, 1), "mlp.gate_proj": (2, 1), "mlp.up_proj": (2, 1), "mlp.down_proj": (1, 2)}


def build(root: Path, layers: int, hidden: int, rank: int) -> tuple[Path, Path, int]:
    """A base directory and an adapter directory; returns them and the dense deltas' bytes."""
    import torch
    from safetensors.torch import save_file

    base, adapter = root / "base", root / "adapter"
    base.mkdir()
    adapter.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "synthetic", "hidden_size": hidden}))
    weights, factors, dense = {}, {}, 0
    g = torch.Generator().manual_seed(0)
    for i in range(layers):
        for module, (out_mult, in_mult) in MODULES.items():
            out_dim, in_dim = hidden * out_mult, hidden * in_mult
            name = f"model.layers.{i}.{module}"
            weights[f"{name}.weight"] = torch.randn(out_dim, in_dim, generator=g, dtype=torch.float32).to(torch.bfloat16)
            factors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, in_dim, generator=g) * 0.01
            factors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(out_dim, rank, generator=g) * 0.01
            dense += 4 * out_dim * in_dim
        if (i + 1) % 4 == 0 or i == layers - 1:  # a few shards, as real bases have
            save_file(weights, str(base / f"model-{i:05d}.safetensors"))
            weights = {}
    save_file(factors, str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}))
    return base, adapter, dense


def _rss() -> tuple[int, int]:
    """(resident bytes now, the peak so far) of this process (VmRSS, VmHWM: per address space, so a
    child's figures start afresh at exec, unlike ru_maxrss, which Linux carries over from the parent)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def run_one(mode: str, base: Path, adapter: Path) -> dict:
    """In this process: stream the merged model to nowhere; report the peak RSS and the bytes sent."""
    import torch  # noqa: F401 - the baseline includes what any merge imports

    from checkpoints import adapter_merge

    before, _ = _rss()
    start = time.perf_counter()
    members = adapter_merge.merged_members(base, adapter)
    if mode == "eager":
        # The earlier implementation: every dense delta computed before the first byte is written.
        held = [f.delta() for f in adapter_merge.lora_factors(adapter).values()]
    sent = sum(len(chunk) for m in members for chunk in m.chunks())
    _, peak = _rss()
    if mode == "eager":
        del held
    return {"mode": mode, "peak_rss_bytes": peak, "baseline_rss_bytes": before, "sent_bytes": sent,
            "seconds": time.perf_counter() - start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="a small model (a smoke run, not a figure)")
    ap.add_argument("--child", nargs=3, metavar=("MODE", "BASE", "ADAPTER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        mode, base, adapter = args.child
        print(json.dumps(run_one(mode, Path(base), Path(adapter))))
        return
    if args.quick:
        args.layers, args.hidden = 2, 512
    with tempfile.TemporaryDirectory(prefix="merge-mem-") as tmp:
        base, adapter, dense = build(Path(tmp), args.layers, args.hidden, args.rank)
        runs = {}
        for mode in ("streamed", "eager"):
            out = subprocess.run([sys.executable, __file__, "--child", mode, str(base), str(adapter)], cwd=ROOT,
                                 capture_output=True, text=True, check=True, env={"PYTHONPATH": str(ROOT),
                                                                                  "PATH": "/usr/bin:/bin"})
            runs[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    s, e = runs["streamed"], runs["eager"]
    assert s["sent_bytes"] == e["sent_bytes"]
    mib = 2**20
    print(f"model: {args.layers} layers x 7 projections, hidden {args.hidden}, rank {args.rank}; "
          f"merged weights {s['sent_bytes'] / mib:,.0f} MiB, dense fp32 deltas {dense / mib:,.0f} MiB")
    for r in (s, e):
        print(f"  {r['mode']:<9} peak RSS {r['peak_rss_bytes'] / mib:8,.0f} MiB  (process baseline "
              f"{r['baseline_rss_bytes'] / mib:,.0f} MiB; {r['seconds']:.1f} s)")
    growth_s = s["peak_rss_bytes"] - s["baseline_rss_bytes"]
    growth_e = e["peak_rss_bytes"] - e["baseline_rss_bytes"]
    print(f"  merge's own memory: streamed {growth_s / mib:,.0f} MiB, eager {growth_e / mib:,.0f} MiB "
          f"({growth_e / max(growth_s, 1):.1f}x)")
    print(json.dumps({"bench": "merge_memory", "layers": args.layers, "hidden": args.hidden, "rank": args.rank,
                      "merged_mib": round(s["sent_bytes"] / mib), "dense_deltas_mib": round(dense / mib),
                      "streamed_peak_mib": round(s["peak_rss_bytes"] / mib),
                      "eager_peak_mib": round(e["peak_rss_bytes"] / mib),
                      "streamed_growth_mib": round(growth_s / mib), "eager_growth_mib": round(growth_e / mib),
                      "fits_1gib_pod": s["peak_rss_bytes"] < 2**30, "quick": args.quick}))


if __name__ == "__main__":
    main()
