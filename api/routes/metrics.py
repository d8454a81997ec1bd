"""`GET /metrics`: Prometheus text built from the workers' Redis beacons at scrape time.

Workers are separate processes (and several API replicas may serve scrapes), so nothing is kept in
this process: every scrape reads the current beacons (the API processes' own, core.loop_lag, among
them). Only aggregates are exposed, no tenant data.
"""

from __future__ import annotations

import itertools
import json

from fastapi import APIRouter, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from api.deps import Pool, RedisDep
from api.input_guard import GuardedRoute
from bases import catalog
from core import health, loop_lag
from core.settings import get_core_settings

router = APIRouter(route_class=GuardedRoute, tags=["service"])

# beacon field -> (metric name, help, kind)
_TRAINER_FIELDS = {
    "rounds": ("quilt_trainer_rounds", "fused rounds run", "counter"),
    "requests": ("quilt_trainer_requests", "requests completed", "counter"),
    "tokens": ("quilt_trainer_tokens", "model-input tokens in fused passes", "counter"),
    "padded_tokens": ("quilt_trainer_padded_tokens", "tokens computed including padding", "counter"),
    "models_fused": ("quilt_trainer_models_fused", "sum over rounds of models in the pass", "counter"),
    "tenants_fused": ("quilt_trainer_tenants_fused", "sum over rounds of tenants in the pass", "counter"),
    "busy_s": ("quilt_trainer_busy_seconds", "time computing", "counter"),
    "wait_s": ("quilt_trainer_wait_seconds", "time waiting for work", "counter"),
    "queued": ("quilt_trainer_queued_requests", "requests waiting in the trainer", "gauge"),
    "models": ("quilt_trainer_models", "training models held", "gauge"),
    "resident": ("quilt_trainer_resident_adapters", "adapters on the compute device", "gauge"),
    "offloaded": ("quilt_trainer_offloaded_adapters", "adapters parked on the offload device", "gauge"),
}


class _Snapshot:
    def __init__(self, beacons: dict[tuple[str, str], dict], lags: dict[str, loop_lag.LagHistogram]):
        self.beacons, self.lags = beacons, lags

    def collect(self):
        for field, (name, doc, kind) in _TRAINER_FIELDS.items():
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = cls(name, doc, labels=["base_model", "shard"])
            for (base, shard), beacon in self.beacons.items():
                if field in beacon:
                    family.add_metric([base, shard], float(beacon[field]))
            yield family
        lag = HistogramMetricFamily("quilt_api_event_loop_lag_seconds",
                                    "how late each API process's event loop woke a task asking to run every "
                                    "QUILT_LOOP_LAG_PROBE_S (core.loop_lag)", labels=["instance"])
        for instance, hist in self.lags.items():
            cumulative = list(itertools.accumulate(hist.counts))
            lag.add_metric([instance], [(f"{b:g}", c) for b, c in zip(loop_lag.BOUNDS, cumulative)]
                           + [("+Inf", cumulative[-1])], hist.sum_s)
        yield lag


@router.get("/metrics", include_in_schema=False)
async def metrics(pool: Pool, redis: RedisDep) -> Response:
    """Prometheus exposition of trainer round statistics and of each API process's event-loop lag."""
    async with pool.connection() as conn:
        bases = await catalog.list_models(conn)
    beacons = {}
    shards = get_core_settings().trainer_shards
    for base in bases:
        for name, key in health.trainer_keys(base.name, shards).items():
            raw = await redis.get(key)
            if raw:  # labelled by base and shard ("" with one trainer per base)
                beacons[(base.name, name.partition("@")[2])] = json.loads(raw)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(beacons, await loop_lag.read_all(redis)))
    return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")
