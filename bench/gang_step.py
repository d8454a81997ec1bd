"""What a trainer gang costs and gives: the same fused step (N tenants x T tokens each: one
forward/backward over the base, then an AdamW step per tenant) run by one process and by a gang of R
ranks splitting the base (batcher.engine.gang), side by side, alternating, in one run.

A gang exists for bases that do not fit one device; what it may cost is the collectives of every
layer (the base's own and the split LoRA's). On the CPU the comparison is fair in cores: each gang
rank gets one thread (torch.distributed.run's default), the single process as many threads as there
are ranks; gloo's all-reduces over loopback are the cost being measured. On GPUs (R of them: only a
machine with several can run this) it is NCCL over NVLink and the speed-up of splitting every
matmul. Which regime favours the gang: large hidden sizes and many tokens per pass (compute split R
ways, collectives tokens x hidden); which does not: small models and short passes, where the
per-layer collectives dominate.

    python bench/gang_step.py [--ranks 2] [--parallel tp] [--tenants 8] [--tokens 128]
                              [--hidden 1024 --layers 8] [--device cpu|cuda] [--rounds 2]

Ends with one JSON line of headline figures.
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--parallel", default="tp", choices=("tp", "fsdp"))
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128, help="tokens per tenant per step")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=4, help="timed steps per measurement (after one warm-up)")
    p.add_argument("--rounds", type=int, default=2, help="alternating measurements of each side")
    p.add_argument("--role", choices=("one", "gang"), help=argparse.SUPPRESS)
    p.add_argument("--base", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _steps(backend, args) -> list[float]:
    """Seconds of each timed step: every tenant's forward/backward fused in one pass, then their steps."""
    import torch

    from batcher.engine.protocol import PassRequest
    from core.loss_spec import LossConfig
    from core.work import AdamParams, Datum, LoraShape, PassWork

    adam = AdamParams(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=1.0)
    models = [f"m{i}" for i in range(args.tenants)]
    for i, m in enumerate(models):
        backend.create(m, LoraShape(rank=16, seed=i, train_unembed=False))
    requests = []
    for i, m in enumerate(models):
        toks = tuple((7 * i + j) % 1000 + 3 for j in range(args.tokens + 1))
        datum = Datum(toks[:-1], {"target_tokens": toks[1:], "weights": (1.0,) * args.tokens})
        requests.append(PassRequest(m, m, PassWork("cross_entropy", LossConfig(), (datum,)), False))
    times = []
    for step in range(args.steps + 1):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        outs = backend.run_pass(requests)
        assert all(isinstance(o, dict) for o in outs), outs[:1]
        for m in models:
            backend.optim_step(m, adam)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        if step:  # the first is the warm-up
            times.append(time.perf_counter() - started)
    return times


def _role(args) -> None:
    import torch

    from batcher.engine import gang
    from batcher.engine.backend import LoraBackend

    if args.role == "one":
        torch.set_num_threads(args.ranks)
        times = _steps(LoraBackend(args.base, device=args.device, dtype=torch.float32), args)
        Path(args.out).write_text(json.dumps(times))
        return
    member = gang.join(gang.GangShape(args.ranks, args.parallel), args.device)
    backend = LoraBackend(args.base, device=args.device, dtype=torch.float32, member=member)
    if member.leader:
        leader = gang.lead(backend, member)
        times = _steps(backend, args)
        leader.close()
        Path(args.out).write_text(json.dumps(times))
    else:
        gang.follow(backend, member)
    gang.leave()


def _measure(args, role: str, base: Path, out: Path) -> list[float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "sdk")]), "HF_HUB_OFFLINE": "1"}
    tail = [str(Path(__file__).resolve()), "--role", role, "--base", str(base), "--out", str(out),
            "--ranks", str(args.ranks), "--parallel", args.parallel, "--tenants", str(args.tenants),
            "--tokens", str(args.tokens), "--device", args.device, "--steps", str(args.steps)]
    if role == "one":
        cmd = [sys.executable, *tail]
    else:
        env.setdefault("OMP_NUM_THREADS", "1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks),
               *tail]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"{role} failed:\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def main() -> None:
    args = _args()
    if args.role:
        _role(args)
        return
    from stack.tiny_model import TinyModelSpec, build_tiny_model

    heads = max(4, args.hidden // 128)
    spec = TinyModelSpec(hidden_size=args.hidden, num_layers=args.layers, num_attention_heads=heads,
                         num_key_value_heads=max(2, heads // 2), head_dim=128, intermediate_size=3 * args.hidden)
    with tempfile.TemporaryDirectory() as tmp:
        base = build_tiny_model(Path(tmp) / "base", spec=spec).path
        one, gang = [], []
        for r in range(args.rounds):  # alternating, so drift on a shared machine hits both sides
            one += _measure(args, "one", base, Path(tmp) / f"one{r}.json")
            gang += _measure(args, "gang", base, Path(tmp) / f"gang{r}.json")
    t_one, t_gang = statistics.median(one), statistics.median(gang)
    tokens = args.tenants * args.tokens
    print(f"{args.tenants} tenants x {args.tokens} tokens, hidden {args.hidden}, {args.layers} layers, "
          f"{args.device}; gang: {args.ranks} ranks, {args.parallel}")
    print(f"  one process ({args.ranks} threads)   {t_one * 1e3:9.1f} ms/step   {tokens / t_one:9.0f} tokens/s")
    print(f"  gang of {args.ranks} (1 thread each)   {t_gang * 1e3:9.1f} ms/step   {tokens / t_gang:9.0f} tokens/s")
    print(f"  gang / one: {t_gang / t_one:.2f}x the time")
    print(json.dumps({"bench": "gang_step", "device": args.device, "ranks": args.ranks, "parallel": args.parallel,
                      "tenants": args.tenants, "tokens": args.tokens, "hidden": args.hidden, "layers": args.layers,
                      "one_ms": round(t_one * 1e3, 2), "gang_ms": round(t_gang * 1e3, 2),
                      "gang_over_one": round(t_gang / t_one, 3)}))


if __name__ == "__main__":
    main()
