"""What one poll per sampling session saves: the official tinker SDK and the Quilt SDK sampling a
burst of requests against an embedded stack, with the server's `retrieve_futures` protocol (one
long-poll per sampling client) against per-request polling (one `retrieve_future` long-poll per
sample in flight, each an API connection and a Redis connection blocked on its future: what each
SDK does against a server without the protocol). Side by side in one run, interleaved: `--bursts`
of `--requests` samples of `--max-tokens` tokens each, per SDK and arm.

Prints, per arm: the burst's wall time (median); the API's Redis connections blocked in XREAD
on futures while the burst ran (read from Redis' CLIENT LIST every 20 ms: max and mean); and the
burst's results still stored in Redis a second after it (the session poll reports the results it
has read, which are then deleted; per-request polling leaves them for QUILT_FUTURE_TTL_SECONDS). Which
regime favours the session poll: many samples in flight per client (an RL step's groups), where
per-request polling holds one connection each. Which does not: one sample at a time, where both
hold one poll.

    python bench/session_poll.py [--requests 64] [--bursts 3] [--max-tokens 8]

Ends with one JSON line.
"""

from __future__ import annotations

import _root  # noqa: F401  first: this checkout's packages on sys.path (bench/_root.py)

import argparse
import contextlib
import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import quilt  # noqa: E402
import redis  # noqa: E402
import tinker  # noqa: E402
from tinker import types  # noqa: E402

from core.queue import future_key  # noqa: E402
from stack.ephemeral import TINY, ephemeral_stack, new_tenant  # noqa: E402

ARMS = ("per_request", "session")
SDKS = ("tinker", "quilt")
MAX_TOKENS = 8


class BlockedReads:
    """Counts the Redis clients blocked in XREAD (the API's long-polls; workers read with XREADGROUP)."""

    def __init__(self, url: str):
        self.client = redis.Redis.from_url(url)
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            # `cmd` is a connection's last command: only flag `b` says it is blocked in it now.
            self.samples.append(sum(1 for c in self.client.client_list()
                                    if c.get("cmd") == "xread" and "b" in c.get("flags", "")))

    def __enter__(self) -> BlockedReads:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def sampler_of(sdk: str, arm: str, base_url: str, key: str) -> Iterator[Callable[[], object]]:
    """A function submitting one sample through `sdk` (tinker or quilt), polling per request or
    through the session poll."""
    prompt = [40, 41, 42, 43]
    if sdk == "tinker":
        with tinker.ServiceClient(base_url=base_url, api_key=key) as service:
            if arm == "per_request":  # the SDK as it runs against a server without the protocol
                holder = service.holder
                holder._client_config = holder._client_config.model_copy(update={"sample_use_retrieve_futures": False})
            sampler = service.create_sampling_client(base_model=TINY).result()  # 0.38: a future of the client
            params = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=1, stop=[])
            yield lambda: sampler.sample(types.ModelInput.from_ints(prompt), 1, params)
    else:
        with quilt.Client(api_key=key, base_url=base_url) as client:
            sampler = client.create_sampling_client(base_model=TINY)
            sampler._poller.off = arm == "per_request"  # as against a server without the route
            params = quilt.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=1, stop=[])
            yield lambda: sampler.sample(prompt, 1, params)


def burst(submit: Callable[[], object], n: int) -> float:
    start = time.perf_counter()
    futures = [submit() for _ in range(n)]
    assert all(len(f.result().sequences[0].tokens) == MAX_TOKENS for f in futures)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    global MAX_TOKENS
    MAX_TOKENS = args.max_tokens
    cells = [(sdk, arm) for sdk in SDKS for arm in ARMS]
    results = {cell: {"wall": [], "blocked": [], "kept": [], "kept_bytes": []} for cell in cells}
    with ephemeral_stack() as stack:
        _tenant, key = new_tenant(stack, "poll", max_inflight_requests=100_000, tokens_per_minute=10**9)
        store = redis.Redis.from_url(stack.redis_url)
        for i in range(args.bursts + 1):  # the first round warms the engine and the SDKs
            for cell in cells:
                before = set(store.keys(future_key("*")))
                with sampler_of(*cell, stack.base_url, key) as submit, BlockedReads(stack.redis_url) as blocked:
                    wall = burst(submit, args.requests)
                    time.sleep(1)  # the session poll reports what it read on its next poll
                kept = set(store.keys(future_key("*"))) - before
                if i:
                    results[cell]["wall"].append(wall)
                    results[cell]["blocked"].extend(blocked.samples)
                    results[cell]["kept"].append(len(kept))
                    results[cell]["kept_bytes"].append(sum(store.memory_usage(k) or 0 for k in kept))
    print(f"{args.requests} samples of {args.max_tokens} tokens in flight at once, {args.bursts} bursts per arm, "
          "interleaved; the tiny base on the CPU engine")
    print(f"{'sdk':<7} {'arm':<12} {'burst s (median)':>17} {'blocked XREADs max':>19} {'mean':>6} "
          f"{'results kept after':>19} {'their bytes':>12}")
    out: dict = {"requests": args.requests, "bursts": args.bursts}
    for sdk, arm in cells:
        res = results[(sdk, arm)]
        wall, blocked, kept = statistics.median(res["wall"]), res["blocked"], max(res["kept"])
        kept_bytes = max(res["kept_bytes"])
        print(f"{sdk:<7} {arm:<12} {wall:>17.2f} {max(blocked):>19} {statistics.mean(blocked):>6.1f} {kept:>19} "
              f"{kept_bytes:>12,}")
        out.setdefault(sdk, {})[arm] = {"burst_s": round(wall, 3), "blocked_max": max(blocked),
                                        "blocked_mean": round(statistics.mean(blocked), 2), "results_kept": kept,
                                        "results_kept_bytes": kept_bytes}
    for sdk in SDKS:
        out[sdk]["burst_session_over_per_request"] = round(
            out[sdk]["session"]["burst_s"] / out[sdk]["per_request"]["burst_s"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
