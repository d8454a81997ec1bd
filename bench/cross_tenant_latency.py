"""How much can one tenant's big training request delay another tenant's small one?

The trainer runs one round at a time, and a round's fused pass is atomic: a small request that
arrives while a round runs waits for it. The planner (batcher.policy) fills a round up to the
token budget (`QUILT_TRAINER_TOKEN_BUDGET`, 16,384) and runs a request larger than the budget
alone, split into budget-sized passes; so the delay a bystander can suffer is one round of at most
max(token budget, largest request) tokens, the largest request bounded by
`QUILT_MAX_TOKENS_PER_REQUEST` (262,144). Measured here on the embedded tiny base with the real
backend and planner, side by side in one run:

  alone       the bystander's 64-token forward_backward by itself;
  behind B    the same request arriving just after a B-token request of another tenant started:
              it waits that round, then runs (its latency is the two rounds);
  both queued the two requests queued together: the planner's fair share runs the small one first
              when the big one exceeds its share, so the bystander waits only for its own round.

Which regime favours Quilt: bystanders whose requests are queued when a round is planned (fair
share puts them first). Which does not: a bystander arriving just after a large request started,
which nothing but a smaller budget (or preemption, not built) would shorten.

    python bench/cross_tenant_latency.py [--quick]

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
from batcher.policy import FairShare, ModelQueue, Pending, plan_round  # noqa: E402
from core.loss_spec import LossConfig  # noqa: E402
from core.settings import get_api_settings, get_trainer_settings  # noqa: E402
from core.work import Datum, LoraShape, PassWork  # noqa: E402
from stack.tiny_model import build_tiny_model  # noqa: E402

ROW = 512  # tokens per datum of the big request


def _request(rid: str, model_id: str, n_tokens: int, row: int) -> PassRequest:
    data = []
    for start in range(0, n_tokens, row):
        n = min(row, n_tokens - start)
        toks = tuple((7 * (start + i)) % 1000 + 1 for i in range(n + 1))
        data.append(Datum(toks[:-1], {"target_tokens": toks[1:], "weights": (1.0,) * n}))
    return PassRequest(rid, model_id, PassWork("cross_entropy", LossConfig(), tuple(data)), forward_only=False)


def _timed(be: LoraBackend, req: PassRequest) -> float:
    started = time.perf_counter()
    out = be.run_pass([req])[0]
    assert isinstance(out, dict), out
    return time.perf_counter() - started


def _first_round(budget: int, big_tokens: int) -> str:
    queues = [ModelQueue("big", 1, (Pending("r-big", "big", "tenant-a", 1, "forward_backward", big_tokens),)),
              ModelQueue("small", 1, (Pending("r-small", "small", "tenant-b", 1, "forward_backward", 64),))]
    plan = plan_round(queues, FairShare(budget))
    return "+".join(sorted(p.model_id for p in plan.fused))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    budget = get_trainer_settings().token_budget
    largest = get_api_settings().max_tokens_per_request
    sizes = [budget // 4, budget] if args.quick else [budget // 4, budget, 4 * budget]
    reps = 2 if args.quick else 3

    with tempfile.TemporaryDirectory() as tmp:
        base = build_tiny_model(Path(tmp) / "tiny").path
        be = LoraBackend(base, max_tokens_per_pass=budget)
        for m in ("big", "small"):
            be.create(m, LoraShape(rank=16, seed=0))
        small = _request("r-small", "small", 64, 64)
        _timed(be, small)  # warm-up
        alone = statistics.median(_timed(be, small) for _ in range(reps))
        rows = []
        for size in sizes:
            big = _request("r-big", "big", size, ROW)
            round_s = statistics.median(_timed(be, big) for _ in range(reps))
            behind = round_s + alone
            first = _first_round(budget, size)
            queued = {"small": alone, "big+small": round_s}.get(first, behind)
            rows.append({"big_tokens": size, "passes": -(-size // budget), "big_round_s": round_s,
                         "behind_s": behind, "behind_over_alone": behind / alone, "first_round": first,
                         "queued_s": queued})

    print(f"token budget {budget} tokens per pass; largest request {largest} tokens; bystander 64 tokens, "
          f"alone {alone * 1000:.0f} ms (median of {reps})\n")
    print(f"{'big request':>12} {'passes':>6} {'its round':>10} {'bystander behind it':>20} {'x alone':>8} "
          f"{'both queued: first round':>26} {'bystander':>10}")
    for r in rows:
        print(f"{r['big_tokens']:>12,} {r['passes']:>6} {r['big_round_s']:>9.2f}s {r['behind_s']:>19.2f}s "
              f"{r['behind_over_alone']:>7.1f}x {r['first_round']:>26} {r['queued_s']:>9.2f}s")
    at_budget = next(r for r in rows if r["big_tokens"] == budget)
    per_token = at_budget["big_round_s"] / budget
    print(f"\nworst case for the largest request allowed ({largest:,} tokens): about "
          f"{per_token * largest:.0f} s added (extrapolated at {per_token * 1e6:.0f} us per token); "
          "lower QUILT_MAX_TOKENS_PER_REQUEST or QUILT_TRAINER_TOKEN_BUDGET to bound it tighter")
    print(json.dumps({
        "bench": "cross_tenant_latency", "token_budget": budget, "small_alone_s": round(alone, 4),
        "added_s_behind_budget_request": round(at_budget["big_round_s"], 3),
        "behind_over_alone_at_budget": round(at_budget["behind_over_alone"], 2),
        "queued_together_small_first": all(r["first_round"] == "small" for r in rows if r["big_tokens"] > budget // 2),
        "added_s_extrapolated_largest_request": round(per_token * largest, 1),
    }))


if __name__ == "__main__":
    main()
