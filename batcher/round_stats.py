"""A trainer's round statistics: cumulative counters for its liveness beacon (the operator page, the
scale-out planner's load) and a capped Redis list of per-round records for the dashboard."""

from __future__ import annotations

import contextlib
import json
import time
from collections import deque
from typing import Any

from batcher.engine.protocol import PassStats
from batcher.policy import RoundPlan
from core import health, stores

RECENT_TOKENS_S = 60.0  # the window of a shard's "recent tokens" (scaleout.placement's load)


class RoundStats:
    def __init__(self, *, redis: Any, base_model: str, shard: str | None, history: int) -> None:
        self.redis = redis
        self.key = health.trainer_rounds_key(base_model)
        self.shard = shard
        self.history = history
        self.counters = {"rounds": 0, "requests": 0, "busy_s": 0.0, "wait_s": 0.0, "tokens": 0, "padded_tokens": 0,
                         "models_fused": 0, "tenants_fused": 0, "fused_rounds": 0, "started_at": time.time()}
        self._recent_tokens: deque[tuple[float, int]] = deque()  # (when, tokens) of recent passes
        self._queue_waits: deque[float] = deque(maxlen=health.WAITS_KEPT)  # seconds, recent requests

    def started(self, waits: list[float]) -> None:
        """The queue waits of requests a round has just taken (arrival in the stream to their round)."""
        self._queue_waits.extend(waits)

    def add(self, name: str, amount: float) -> None:
        self.counters[name] = self.counters.get(name, 0) + amount

    def record(self, plan: RoundPlan, ps: PassStats | None, compute_s: float, wait_s: float) -> None:
        """One round that ran `plan` (its pass's statistics `ps`, None without a pass): counted, and
        its record pushed to the dashboard's list (not worth waiting for while Redis is down)."""
        tenants = len({p.tenant_id for p in plan.fused})
        record: dict[str, Any] = {
            "at": time.time(), "models": ps.models if ps else 0, "tenants": tenants,
            "requests": len(plan.fused) + len(plan.barriers), "barriers": len(plan.barriers),
            "tokens": ps.tokens if ps else 0, "padded_tokens": ps.padded_tokens if ps else 0,
            "padding_fraction": round(ps.padding_fraction, 4) if ps else 0.0,
            "micro_batches": ps.micro_batches if ps else 0,
            "compute_s": round(compute_s, 6), "wait_s": round(wait_s, 6),
        }
        if self.shard:
            record["shard"] = self.shard
        self.add("busy_s", compute_s)
        self.add("rounds", 1)
        if ps:
            self._recent_tokens.append((time.monotonic(), ps.tokens))
            self.add("tokens", ps.tokens)
            self.add("padded_tokens", ps.padded_tokens)
            self.add("models_fused", ps.models)
            self.add("tenants_fused", tenants)
            self.add("fused_rounds", 1)  # rounds with a pass: tenants_fused / fused_rounds is the mean
        pipe = self.redis.pipeline()
        pipe.lpush(self.key, json.dumps(record))
        pipe.ltrim(self.key, 0, self.history - 1)
        with contextlib.suppress(*stores.STORE_ERRORS):
            pipe.execute()

    def beacon_fields(self) -> dict[str, Any]:
        """The counters as the liveness beacon carries them, with the tokens of the last minute."""
        while self._recent_tokens and self._recent_tokens[0][0] < time.monotonic() - RECENT_TOKENS_S:
            self._recent_tokens.popleft()
        fields = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.counters.items()
                  if k != "started_at"}
        return {"recent_tokens": sum(n for _, n in self._recent_tokens), **fields,
                **health.wait_figures(self._queue_waits)}
