"""What durable training costs the trainer: snapshot time against training time, side by side.

The trainer snapshots a model's adapter and AdamW state after every optimizer step by default
(`QUILT_TRAINER_SNAPSHOT_EVERY_STEPS=1`, `batcher.snapshots`), synchronously, before the step's
stream entries are acknowledged. Measured here on the bench model of `bench/trainer_fusion.py`
(random Qwen3, 33.6M parameters) for one model's RL-style step, interleaved repetitions of:

  step      forward_backward over B tokens (64-token rows) + optim_step: the trainer's busy time;
  snapshot  SnapshotStore.write of the same model (safetensors + torch.save, renamed into place).

The ratio snapshot/step is the cost in trainer busy time, at 1 step per snapshot; at N steps per
snapshot it divides by N. Which regime favours snapshots: large steps (many tokens per optimizer
step, the usual RL step); which does not: tiny steps of a high-rank adapter, where writing the
adapter and its two Adam moments takes as long as computing the step.

    python bench/snapshot_cost.py [--quick]

Ends with one JSON line of headline figures.
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from batcher.engine.backend import LoraBackend  # noqa: E402
from batcher.engine.protocol import PassRequest  # noqa: E402
from batcher.snapshots import SnapshotStore  # noqa: E402
from core.loss_spec import LossConfig  # noqa: E402
from core.work import AdamParams, Datum, LoraShape, PassWork  # noqa: E402

ROW = 64


def _datums(n_tokens: int) -> tuple[Datum, ...]:
    out = []
    for start in range(0, n_tokens, ROW):
        toks = tuple((13 * (start + i)) % 4000 + 1 for i in range(ROW + 1))
        out.append(Datum(toks[:-1], {"target_tokens": toks[1:], "weights": (1.0,) * ROW}))
    return tuple(out)


def main() -> None:
    from trainer_fusion import build_base

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer repetitions")
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    hidden, layers, vocab = (256, 4, 4096) if args.quick else (512, 8, 8192)
    reps = 2 if args.quick else 3
    ranks = (16,) if args.quick else (16, 64)
    step_tokens = (512,) if args.quick else (512, 4096, 16384)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        params = build_base(Path(tmp) / "base", hidden=hidden, layers=layers, vocab=vocab)
        be = LoraBackend(str(Path(tmp) / "base"), max_tokens_per_pass=16384)
        store = SnapshotStore(Path(tmp) / "snapshots")
        for rank in ranks:
            be.create("m", LoraShape(rank=rank, seed=0))
            for n in step_tokens:
                req = PassRequest("r", "m", PassWork("cross_entropy", LossConfig(), _datums(n)), False)

                def step():
                    be.run_pass([req])
                    be.optim_step("m", AdamParams(learning_rate=1e-4))

                step()
                store.write(be, "m", 0)  # warm-up
                step_s, snap_s = [], []
                for seq in range(1, reps + 1):
                    started = time.perf_counter()
                    step()
                    step_s.append(time.perf_counter() - started)
                    started = time.perf_counter()
                    size = store.write(be, "m", seq)
                    snap_s.append(time.perf_counter() - started)
                s, w = statistics.median(step_s), statistics.median(snap_s)
                rows.append({"rank": rank, "tokens": n, "step_s": s, "snapshot_s": w, "bytes": size,
                             "cost": w / s})
    print(f"bench model: random Qwen3, {params / 1e6:.1f}M parameters, {torch.get_num_threads()} threads; "
          f"median of {reps}\n")
    print(f"{'rank':>4} {'tokens/step':>11} {'step':>9} {'snapshot':>9} {'size':>9} {'cost (1 step/snapshot)':>23}")
    for r in rows:
        print(f"{r['rank']:>4} {r['tokens']:>11,} {r['step_s'] * 1000:>7.0f}ms {r['snapshot_s'] * 1000:>7.0f}ms "
              f"{r['bytes'] / 1e6:>7.1f}MB {r['cost'] * 100:>22.1f}%")
    default = next((r for r in rows if r["rank"] == 16 and r["tokens"] == 4096), rows[0])
    print(json.dumps({"bench": "snapshot_cost", "cost_rank16_4096_tokens": round(default["cost"], 4),
                      "cost_max": round(max(r["cost"] for r in rows), 4),
                      "cost_min": round(min(r["cost"] for r in rows), 4)}))


if __name__ == "__main__":
    main()
